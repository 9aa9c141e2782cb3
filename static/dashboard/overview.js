/* The overview redraws (throttled) when any task changes. */
(function () {
  "use strict";
  const body = document.getElementById("overview-body");
  if (!body) return;
  const url = body.dataset.fragmentUrl;
  const redraw = Live.throttle(async function () {
    const resp = await fetch(url, { credentials: "same-origin" });
    if (resp.ok) body.innerHTML = await resp.text();
  }, 1000);
  new Live.LiveSocket("/ws/tasks/", { onMessage: (msg) => { if (msg.type === "task") redraw(); } });
})();
