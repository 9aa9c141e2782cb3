/* Task page: the push configs the agent holds, read on request (the agent is asked each time). */
(function () {
  "use strict";
  const section = document.getElementById("push-section");
  const box = document.getElementById("push-configs");
  if (!section || !box) return;
  async function load() {
    box.setAttribute("aria-busy", "true");
    try {
      const response = await fetch(section.dataset.url, { credentials: "same-origin" });
      box.innerHTML = response.ok ? await response.text() : "<p class=\"small muted\">Could not load the list.</p>";
    } catch (err) {
      box.textContent = "Could not load the list.";
    } finally {
      box.removeAttribute("aria-busy");
    }
  }
  box.addEventListener("click", (event) => {
    if (event.target && event.target.id === "push-configs-load") load();
  });
})();
