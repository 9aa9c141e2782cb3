/* The inbox page, live: a task that starts waiting appears (fetched as a server-rendered
   row, in order of when it was asked), one that stops waiting goes (after a moment, and
   never while someone is typing an answer in it). Summaries come from the badge's socket
   (inbox_badge.js). */
(function () {
  "use strict";
  const box = document.getElementById("inbox-items");
  if (!box || !window.InboxBadge) return;
  const empty = document.getElementById("inbox-empty");
  const countEl = document.getElementById("inbox-count");
  const liveEl = document.getElementById("inbox-live");
  const insert = box.dataset.liveInsert === "1";
  const pending = new Set();
  const dirty = new Set(); // rows someone typed into

  box.addEventListener("input", (ev) => {
    const row = ev.target.closest(".inbox-item");
    if (row) dirty.add(row.dataset.task);
  });
  // Typed into: an input event seen, or a field that differs from how the page drew it (text
  // typed before this script arrived, on a loaded server, made no event it could see).
  function typedIn(row) {
    if (dirty.has(row.dataset.task)) return true;
    return Array.from(row.querySelectorAll("form textarea, form input")).some((el) =>
      el.type === "checkbox" || el.type === "radio" ? el.checked !== el.defaultChecked
        : el.type !== "hidden" && el.type !== "file" && el.value !== el.defaultValue);
  }

  InboxBadge.onStatus((state, text) => {
    if (!liveEl) return;
    liveEl.dataset.state = state;
    liveEl.textContent = "live: " + (text || state);
  });

  function refreshEmpty() {
    if (empty) empty.hidden = box.querySelector(".inbox-item") !== null;
    if (countEl && !InboxBadge.capped) {
      countEl.textContent = String(InboxBadge.count());
      countEl.dataset.count = String(InboxBadge.count());
      const noun = document.getElementById("inbox-noun");
      if (noun) noun.textContent = InboxBadge.count() === 1 ? "task" : "tasks";
    }
  }

  function place(row) {
    // Oldest question first: before the first row asked later than this one.
    const asked = Date.parse(row.dataset.asked || "") || 0;
    const later = Array.from(box.querySelectorAll(".inbox-item")).find(
      (r) => (Date.parse(r.dataset.asked || "") || 0) > asked
    );
    box.insertBefore(row, later || null);
  }

  async function fetchRow(pk, replace) {
    if (pending.has(pk)) return;
    pending.add(pk);
    try {
      const resp = await fetch("/inbox/" + pk + "/row/", { credentials: "same-origin" });
      if (!resp.ok) return;
      const tmp = document.createElement("div");
      tmp.innerHTML = (await resp.text()).trim(); // server-rendered, escaped and sanitized
      const row = tmp.querySelector(".inbox-item");
      if (!row || row.dataset.waiting !== "1") return;
      const current = document.getElementById("inbox-item-" + pk);
      if (current && !replace) return;
      // Stopped waiting, or typed into, while this row was fetched: the row fetched is older
      // news (it put back a form the server would refuse, without its note), or would wipe
      // what was typed.
      if (current && (current.dataset.leaving || typedIn(current))) return;
      if (current) current.replaceWith(row); else place(row);
      row.classList.add("flash-row");
      setTimeout(() => row.classList.remove("flash-row"), 800);
      if (window.Live) Live.tickTimes();
    } finally {
      pending.delete(pk);
      refreshEmpty();
    }
  }

  function remove(pk, label) {
    const row = document.getElementById("inbox-item-" + pk);
    if (!row || row.dataset.leaving) return;
    row.dataset.leaving = "1";
    row.dataset.waiting = "0";
    row.classList.add("inbox-done");
    // What was typed stays readable (to copy), but it can no longer be sent from here:
    // the server would refuse it, and the button invited a try that lost the text.
    row.querySelectorAll("form button, form input[type=submit]").forEach((b) => { b.disabled = true; });
    if (!row.querySelector(".inbox-left")) {
      const note = document.createElement("p");
      note.className = "muted inbox-left";
      note.setAttribute("role", "status");
      note.textContent = "No longer waiting" + (label ? " (" + label + ")" : "") + ".";
      row.appendChild(note);
    }
    if (typedIn(row)) return; // keep what was typed in view; the server would refuse it now
    setTimeout(() => { row.remove(); refreshEmpty(); }, 1500);
  }

  InboxBadge.subscribe((s, waiting) => {
    const pk = String(s.task);
    const row = document.getElementById("inbox-item-" + pk);
    if (!waiting) {
      if (row) remove(pk, (s.state || s.phase || "").replace("TASK_STATE_", "").toLowerCase().replace(/_/g, " "));
      refreshEmpty();
      return;
    }
    if (!row) {
      if (insert) fetchRow(pk, false);
    } else if ((s.last_seq || 0) > parseInt(row.dataset.seq || "0", 10) && !typedIn(row) && !row.dataset.leaving) {
      fetchRow(pk, true); // maybe a new question (or its answer): redraw the row
    }
    refreshEmpty();
  });
})();
