/* Agent page: while an import job is queued or running, redraw its card from the server. */
(function () {
  "use strict";
  const POLL_MS = 1500;
  async function poll() {
    const box = document.getElementById("import-job");
    if (!box || box.dataset.active !== "1") return;
    try {
      const resp = await fetch(box.dataset.url, { credentials: "same-origin", headers: { Accept: "text/html" } });
      if (resp.ok) {
        const tmp = document.createElement("div");
        tmp.innerHTML = await resp.text(); // server-rendered, escaped by the template
        const fresh = tmp.querySelector("#import-job");
        if (fresh) box.replaceWith(fresh);
      }
    } catch (e) {
      /* a failed poll is retried below */
    }
    setTimeout(poll, POLL_MS);
  }
  setTimeout(poll, POLL_MS);
})();
