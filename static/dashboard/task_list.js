/* The task list: rows change in place; new matching tasks appear at the top
   (on the first page of the default order) without moving what one reads.
   A lost summary is repaired by the re-sync (below). */
(function () {
  "use strict";
  const tbody = document.getElementById("task-rows");
  if (!tbody) return;
  const filters = JSON.parse(document.getElementById("live-filters").textContent);
  const labels = JSON.parse(document.getElementById("state-labels").textContent);
  const phaseLabels = JSON.parse(document.getElementById("phase-labels").textContent);
  const TERMINAL = ["TASK_STATE_COMPLETED", "TASK_STATE_FAILED", "TASK_STATE_CANCELED", "TASK_STATE_REJECTED"];
  const known = new Map(); // task pk -> last_seq shown

  tbody.querySelectorAll("tr[data-task]").forEach((tr) => known.set(tr.dataset.task, parseInt(tr.dataset.seq || "0", 10)));

  function matches(s) {
    if (filters.agent && String(s.agent) !== String(filters.agent)) return false;
    if (filters.state === "active" && TERMINAL.includes(s.state)) return false;
    if (filters.state === "open" && (TERMINAL.includes(s.state) || s.phase === "message" ||
        s.watcher_status === "abandoned" || s.watcher_status === "gone")) return false;
    if (filters.state && filters.state !== "active" && filters.state !== "open" && s.state !== filters.state) return false;
    if (filters.phase && (s.state || s.phase !== filters.phase)) return false;
    if (filters.context && s.context_id !== filters.context) return false;
    if (filters.q) {
      const q = filters.q.toLowerCase();
      const title = (s.title || "").toLowerCase();
      const rid = (s.remote_id || "").toLowerCase();
      if (!title.includes(q) && !rid.startsWith(q)) return false;
    }
    return true;
  }

  function shortState(st) {
    return st ? st.replace("TASK_STATE_", "").toLowerCase().replace(/_/g, "-") : "phase-";
  }

  function updateRow(tr, s) {
    const seq = s.last_seq || 0;
    const shown = parseInt(tr.dataset.seq || "0", 10);
    if (shown > seq) return; // older news
    const badge = tr.querySelector(".state-cell .badge");
    const watch = tr.querySelector(".watch-cell");
    const label = s.state ? (labels[s.state] || s.state) : (phaseLabels[s.phase] || s.phase);
    const watcher = s.watcher_status || "";
    if (shown === seq && (!badge || badge.textContent === label) && (!watch || watch.textContent === watcher)) return; // nothing new (a re-sync repeats rows)
    tr.dataset.seq = seq;
    if (badge) {
      badge.className = "badge st-" + (s.state ? shortState(s.state) : "phase-" + s.phase);
      badge.dataset.state = s.state || "";
      badge.textContent = label;
    }
    if (watch) watch.textContent = watcher;
    const time = tr.querySelector("time");
    // As the server writes it (TIME_ZONE is UTC): the summary's time is in UTC.
    if (time && s.updated_at) { time.setAttribute("datetime", s.updated_at); time.textContent = new Date(s.updated_at).toISOString().slice(0, 19).replace("T", " ") + " UTC"; }
    const wasStale = tr.classList.contains("stale");
    tr.classList.toggle("stale", !matches(s));
    if (!wasStale && tr.classList.contains("stale")) noteChange(false);
    tr.classList.add("flash-row");
    setTimeout(() => tr.classList.remove("flash-row"), 800);
  }

  // The count is the server's, as the page loaded: a task that arrives or stops matching
  // live is said beside it (the list cannot know what changed on the other pages).
  const since = document.getElementById("task-count-since");
  let arrived = 0, left = 0;
  function noteChange(came) {
    if (!since) return;
    if (came) arrived += 1; else left += 1;
    const parts = [];
    if (arrived) parts.push(arrived + " arrived");
    if (left) parts.push(left + " no longer match" + (left === 1 ? "es" : ""));
    since.textContent = " when the page loaded (since then " + parts.join(", ") + ")";
  }

  const pending = new Set();
  async function insertRow(s) {
    const key = String(s.task);
    if (pending.has(key)) return;
    pending.add(key);
    try {
      const resp = await fetch("/tasks/" + s.task + "/row/", { credentials: "same-origin" });
      if (!resp.ok) return;
      const html = await resp.text();
      if (document.getElementById("task-row-" + s.task)) return;
      const tmp = document.createElement("tbody");
      tmp.innerHTML = html.trim(); // server-rendered, escaped
      const tr = tmp.querySelector("tr");
      if (!tr) return;
      const empty = tbody.querySelector("tr.empty");
      if (empty) empty.remove();
      const before = document.documentElement.scrollHeight;
      tbody.insertBefore(tr, tbody.firstChild);
      known.set(key, parseInt(tr.dataset.seq || "0", 10));
      noteChange(true);
      // Keep what the reader looks at in place.
      if (window.scrollY > 0) window.scrollBy(0, document.documentElement.scrollHeight - before);
      tr.classList.add("flash-row");
      setTimeout(() => tr.classList.remove("flash-row"), 800);
    } finally {
      pending.delete(key);
    }
  }

  const queue = new Map();
  let frame = 0;
  function flush() {
    frame = 0;
    queue.forEach((s) => {
      const tr = document.getElementById("task-row-" + s.task);
      if (tr) updateRow(tr, s);
      else if (filters.prepend && matches(s)) insertRow(s);
    });
    queue.clear();
  }

  // Re-sync by version: the newest updated_at we know of (the render time at
  // first). After a (re)connect and when idle we ask for the tasks changed since
  // then (see TaskListConsumer); rows already up to date are left alone.
  const list = Live.taskListFeed(tbody.dataset.version, (msg) => {
    const key = String(msg.task);
    if ((queue.get(key) || {}).last_seq > msg.last_seq) return; // keep the newer one queued
    queue.set(key, msg);
    if (!frame) frame = requestAnimationFrame(flush);
  });
  window.__taskList = { version: list.version };

  // Filters apply as they change (and stay in the URL).
  const form = document.getElementById("task-filters");
  form.querySelectorAll("select").forEach((sel) => sel.addEventListener("change", () => form.requestSubmit()));
})();
