/* Open alerts stay current on the page that shows them (the overview, the inbox).
 *
 * Alerts are opened and resolved by a periodic job, not by a task's own events, so the
 * task-list websocket says nothing about them. Every data-every-ms (ALERT_REFRESH_SECONDS)
 * the section asks its live URL whether the set changed, sending the version it shows: the
 * server answers 204 (one small query) or the new section. Paused while the tab is hidden.
 * The section may be redrawn by the page's own refresh (the overview's body): it is looked
 * up again each time. Ages ("since ...") are kept current here too. */
(function () {
  "use strict";
  if (window.__alertsLive) return; // the template may be included more than once
  window.__alertsLive = true;

  function ago(iso) {
    const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
    if (isNaN(s)) return "";
    const n = (v, unit) => v + " " + unit + (v === 1 ? "" : "s");
    if (s < 60) return n(Math.floor(s), "second");
    if (s < 3600) return n(Math.floor(s / 60), "minute");
    if (s < 86400) return n(Math.floor(s / 3600), "hour");
    return n(Math.floor(s / 86400), "day");
  }

  let busy = false;
  async function check() {
    const el = document.getElementById("alerts");
    if (!el || busy || document.hidden) return;
    busy = true;
    try {
      const url = el.dataset.liveUrl + "?v=" + encodeURIComponent(el.dataset.version || "");
      const resp = await fetch(url, { credentials: "same-origin" });
      if (resp.status !== 200) return;
      const tmp = document.createElement("div");
      tmp.innerHTML = (await resp.text()).trim(); // server-rendered, escaped
      const fresh = tmp.querySelector("#alerts");
      const current = document.getElementById("alerts");
      if (fresh && current) current.replaceWith(fresh);
      tick();
    } catch (e) {
      /* offline for a moment: the next check catches up */
    } finally {
      busy = false;
    }
  }

  function tick() {
    document.querySelectorAll("#alerts time.alert-age").forEach((t) => {
      const text = ago(t.getAttribute("datetime"));
      if (text) t.textContent = text;
    });
  }

  const first = document.getElementById("alerts");
  const every = Math.max(1000, parseInt((first && first.dataset.everyMs) || "5000", 10) || 5000);
  setInterval(check, every);
  setInterval(tick, 5000);
  document.addEventListener("visibilitychange", () => { if (!document.hidden) check(); });
})();
