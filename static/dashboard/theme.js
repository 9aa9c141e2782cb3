/* Dark mode: follows the system unless the user chose; the choice is kept. */
(function () {
  "use strict";
  const root = document.documentElement;
  const saved = localStorage.getItem("theme");
  if (saved === "dark" || saved === "light") root.dataset.theme = saved;
  document.addEventListener("DOMContentLoaded", function () {
    const button = document.getElementById("theme-toggle");
    if (!button) return;
    button.addEventListener("click", function () {
      const systemDark = window.matchMedia("(prefers-color-scheme: dark)").matches;
      const current = root.dataset.theme || (systemDark ? "dark" : "light");
      const next = current === "dark" ? "light" : "dark";
      root.dataset.theme = next;
      localStorage.setItem("theme", next);
    });
  });
})();
