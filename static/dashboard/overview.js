/* The overview redraws (throttled) when any task changes.
 *
 * Re-sync as on the task list (see TaskListConsumer): after a (re)connect and
 * when idle, ask for the tasks changed since the newest updated_at we know of;
 * redraw only for a task whose summary differs from the last one seen, so an
 * idle re-sync costs the server one small query and no render. */
(function () {
  "use strict";
  const body = document.getElementById("overview-body");
  if (!body) return;
  const url = body.dataset.fragmentUrl;
  const redraw = Live.throttle(async function () {
    const resp = await fetch(url, { credentials: "same-origin" });
    if (resp.ok) body.innerHTML = await resp.text();
  }, 1000);
  const seen = new Map(); // task pk -> what its last summary said
  Live.taskListFeed(body.dataset.version, (msg) => {
    const key = [msg.last_seq, msg.state, msg.phase, msg.watcher_status].join("|");
    if (seen.get(msg.task) === key) return;
    seen.set(msg.task, key);
    redraw();
  });
})();
