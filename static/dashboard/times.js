/* Full timestamps (date, time, zone) show how long ago they were on hover: the title is
 * computed when the pointer arrives, so it is never stale. */
(function () {
  "use strict";
  function ago(iso) {
    const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
    if (isNaN(s)) return "";
    if (s < 60) return Math.floor(s) + " seconds ago";
    if (s < 3600) return Math.floor(s / 60) + " minutes ago";
    if (s < 86400) return Math.floor(s / 3600) + " hours ago";
    return Math.floor(s / 86400) + " days ago";
  }
  document.addEventListener("mouseover", function (event) {
    const t = event.target.closest && event.target.closest("time.full-time");
    if (t) t.title = ago(t.getAttribute("datetime"));
  });
})();
