/* The inbox badge in the navigation: how many tasks wait on a person, kept live.
 *
 * The server renders the count and (under its cap) the ids it counted. The task-list
 * socket then brings every readable task's summary; a task waits while its state is
 * input-required or auth-required and it is neither abandoned nor gone (tasks_app/inbox.py says the
 * same on the server). A per-task map of waiting / not waiting (with the last seq seen,
 * so an older summary never undoes a newer one) turns each summary into +1, -1 or
 * nothing. Over the cap the badge says "1000+" and stays so until a reload.
 *
 * Other scripts (the inbox, the task list, the overview) listen through
 * InboxBadge.subscribe(fn) (Live.taskListFeed), so a page has one list socket for all.
 * No inline script: the CSP forbids it.
 */
(function () {
  "use strict";
  const el = document.getElementById("inbox-badge");
  if (!el || !window.Live) return;
  const INTERRUPTED = ["TASK_STATE_INPUT_REQUIRED", "TASK_STATE_AUTH_REQUIRED"];
  const capped = el.dataset.capped === "1";
  const limit = parseInt(el.dataset.limit || "1000", 10);
  let count = parseInt(el.dataset.count || "0", 10);
  const known = new Map(); // task pk -> {waiting, seq}
  (el.dataset.waiting || "").split(",").filter(Boolean).forEach((id) => known.set(id, { waiting: true, seq: 0 }));
  const listeners = [];
  const statusListeners = [];
  let lastStatus = null; // a listener added after the socket opened still hears where it is

  function isWaiting(s) {
    return INTERRUPTED.includes(s.state) && s.watcher_status !== "abandoned" && s.watcher_status !== "gone";
  }

  function show() {
    el.textContent = capped ? limit + "+" : String(count);
    el.dataset.count = String(count);
    el.hidden = !capped && count === 0;
    el.setAttribute("aria-label", (capped ? "more than " + limit : count) + " tasks waiting on a person");
  }

  function onTask(s) {
    const key = String(s.task);
    const seq = s.last_seq || 0;
    const before = known.get(key);
    if (before && before.seq > seq) return; // older news
    const now = isWaiting(s);
    const was = before ? before.waiting : false;
    if (!capped && now !== was) count = Math.max(0, count + (now ? 1 : -1));
    known.set(key, { waiting: now, seq: seq });
    show();
    listeners.forEach((fn) => { try { fn(s, now); } catch (e) { console.warn(e); } });
  }

  /* The list socket (Live.taskListSocket: re-sync by version) on a socket that leaves the
     page's own "live:" status line to the page's own socket. */
  class QuietSocket extends Live.LiveSocket {
    status(state, text) {
      el.dataset.socket = state; // "open" once connected (tests wait for it)
      lastStatus = [state, text];
      statusListeners.forEach((fn) => fn(state, text));
    }
  }
  const { socket, version } = Live.taskListSocket(el.dataset.renderedAt, onTask, QuietSocket);

  window.InboxBadge = {
    subscribe: (fn) => listeners.push(fn),
    onStatus: (fn) => {
      statusListeners.push(fn);
      if (lastStatus) fn(lastStatus[0], lastStatus[1]);
    },
    isWaiting: isWaiting,
    count: () => count,
    capped: capped,
    socket: socket,
    version: version,
  };
})();
