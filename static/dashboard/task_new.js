/* Start-a-task form: show the chosen agent's skills; check JSON as it is typed. */
(function () {
  "use strict";
  const agent = document.getElementById("id_agent");
  const skill = document.getElementById("id_skill");
  const help = document.getElementById("skill-help");
  if (!agent || !skill) return;
  function syncSkills() {
    skill.querySelectorAll("option[data-agent]").forEach((opt) => {
      const mine = opt.dataset.agent === agent.value;
      opt.hidden = !mine;
      opt.disabled = !mine;
      if (!mine && opt.selected) skill.value = "";
    });
    describe();
  }
  function describe() {
    const opt = skill.selectedOptions[0];
    help.textContent = opt && opt.dataset.description
      ? opt.dataset.description + (opt.dataset.examples ? " — e.g. " + opt.dataset.examples : "")
      : "";
  }
  agent.addEventListener("change", syncSkills);
  skill.addEventListener("change", describe);
  syncSkills();

  const data = document.getElementById("id_data");
  if (data) {
    const hint = document.createElement("small");
    hint.className = "help json-hint";
    hint.setAttribute("aria-live", "polite");
    data.insertAdjacentElement("afterend", hint);
    data.addEventListener("input", () => {
      const text = data.value.trim();
      let problem = "";
      if (text) { try { JSON.parse(text); } catch (e) { problem = "Not valid JSON yet: " + e.message; } }
      hint.textContent = problem;
      data.classList.toggle("invalid", !!problem);
    });
  }
})();
