/* The task page: follows the task's log over a websocket and redraws.
 *
 * - Events are applied once, in seq order (idempotent: an old seq is ignored;
 *   a skipped seq makes us reconnect and resume from the last one we have, unless
 *   the server said first that the log itself has a hole there: "gap").
 * - When idle, the socket asks for rows after the last seq (a lost relay).
 * - Text chunks of an artifact are appended at once (textContent only) and the
 *   server's sanitized rendering of that artifact is fetched, throttled; the
 *   block is redrawn in place, so an artifact is one growing block.
 * - Redraws are batched per animation frame / throttled; scroll boxes follow
 *   new content only when they were already at the bottom.
 */
(function () {
  "use strict";

  // As the server's raw views write it (rendering.pretty_json): characters that change how
  // the text around them is drawn (bidi overrides, zero-width, separators, C1) as escapes.
  const DRAWN_WRONG = /[\u007f-\u009f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]/g;
  function shownJson(value) {
    return JSON.stringify(value, null, 2).replace(DRAWN_WRONG, (c) => "\\u" + c.charCodeAt(0).toString(16).padStart(4, "0"));
  }  const page = document.getElementById("task-page");
  if (!page) return;
  const taskPk = page.dataset.task;
  const liveUrl = page.dataset.liveUrl;
  const eventRows = document.getElementById("event-rows");
  const logBox = document.getElementById("event-log-box");
  const convBox = document.getElementById("conversation");
  const artifactsBox = document.getElementById("artifacts");
  const MAX_ROWS = 2000;
  const TERMINAL = ["TASK_STATE_COMPLETED", "TASK_STATE_FAILED", "TASK_STATE_CANCELED", "TASK_STATE_REJECTED"];

  const state = {
    lastSeq: parseInt(page.dataset.pageSeq || "0", 10),
    seqs: [],
    duplicates: 0,
    gaps: 0,
    holes: 0, // holes in the log itself, announced by the server ("gap")
    synced: false,
    socket: null,
  };
  eventRows.querySelectorAll("tr[data-seq]").forEach((tr) => state.seqs.push(parseInt(tr.dataset.seq, 10)));
  window.__taskPage = state;

  // --- the event log table (batched per frame)
  let pendingRows = [];
  let frame = 0;
  function flushRows() {
    frame = 0;
    if (!pendingRows.length) return;
    const follow = Live.atBottom(logBox);
    const frag = document.createDocumentFragment();
    pendingRows.forEach((tr) => frag.appendChild(tr));
    pendingRows = [];
    eventRows.appendChild(frag);
    // Keep the DOM bounded on very long logs (the full log page has everything).
    while (follow && eventRows.childElementCount > MAX_ROWS) eventRows.removeChild(eventRows.firstElementChild);
    if (follow) logBox.scrollTop = logBox.scrollHeight;
  }
  function td(text, cls) {
    const cell = document.createElement("td");
    if (cls) cell.className = cls;
    cell.textContent = text == null ? "" : String(text);
    return cell;
  }
  function eventRow(ev) {
    const tr = document.createElement("tr");
    tr.dataset.seq = ev.seq;
    tr.className = "ev ev-" + ev.kind;
    tr.appendChild(td(ev.seq, "mono"));
    const when = td("", "small");
    const t = document.createElement("time");
    t.className = "full-time";
    t.setAttribute("datetime", ev.received_at || "");
    t.textContent = Live.fullTime(ev.received_at);
    when.appendChild(t);
    tr.appendChild(when);
    tr.appendChild(td(ev.channel, "small"));
    const kind = td(ev.kind);
    if (ev.note) {
      const note = document.createElement("div");
      note.className = "small note";
      note.textContent = ev.note;
      kind.appendChild(note);
    }
    tr.appendChild(kind);
    tr.appendChild(td(ev.state || "—", "small"));
    const rawCell = document.createElement("td");
    const details = document.createElement("details");
    details.className = "raw";
    const summary = document.createElement("summary");
    summary.textContent = "raw";
    const pre = document.createElement("pre");
    pre.className = "json";
    // Too long to be sent live (consumers.SOCKET_RAW_CHARS): "open" shows it.
    pre.textContent = ev.raw_cut ? "(" + ev.raw_cut + " characters: too long to show here)" : shownJson(ev.raw);
    const link = document.createElement("a");
    link.className = "small";
    link.href = "/tasks/" + taskPk + "/events/" + ev.seq + "/";
    link.textContent = "open";
    details.append(summary, pre, link);
    rawCell.appendChild(details);
    tr.appendChild(rawCell);
    return tr;
  }

  // --- the hash chain's sentence (templates/tasks_app/_chain.html): it speaks for the
  // entries up to data-head, checked (or counted) when the page loaded. Rows that arrive
  // live after it were not checked: the sentence says so rather than go on claiming them.
  const chainLine = document.getElementById("chain-status");
  const chainSeq = chainLine ? parseInt(chainLine.dataset.head || "0", 10) : 0;
  let chainNewer = 0;
  function entries(n) { return n + (n === 1 ? " entry" : " entries"); }
  function updateChain() {
    if (!chainLine || isNaN(chainSeq)) return;
    const newer = state.lastSeq - chainSeq;
    if (newer <= 0 || newer === chainNewer) return;
    chainNewer = newer;
    const arrived = entries(newer) + (newer === 1 ? " has" : " have") + " arrived since";
    chainLine.dataset.newer = String(newer);
    if (chainLine.dataset.rows !== undefined) {
      // "Hash chain verifies (N entries)" no longer covers the log shown: say what was checked.
      const reload = document.createElement("a");
      reload.href = window.location.pathname;
      reload.textContent = "reload the page";
      const when = chainLine.querySelector("time");
      const parts = ["Hash chain " + (when ? "verified" : "verifies") + " for the " + entries(parseInt(chainLine.dataset.rows, 10)) + " checked "];
      if (when) parts.push(when, " ago"); else parts.push("when the page loaded");
      parts.push("; " + arrived + " and " + (newer === 1 ? "is" : "are") + " not checked (", reload, " to check them).");
      chainLine.replaceChildren(...parts);
      return;
    }
    // Not verified (too long, not checked now, or broken): only its count of entries is stale.
    let note = chainLine.querySelector(".chain-newer");
    if (!note) {
      note = document.createElement("span");
      note.className = "chain-newer";
      chainLine.appendChild(note);
    }
    note.textContent = " " + arrived + " the page loaded (not checked).";
  }

  // --- state badge (immediate)
  const LABELS = {
    TASK_STATE_SUBMITTED: "submitted", TASK_STATE_WORKING: "working",
    TASK_STATE_INPUT_REQUIRED: "input required", TASK_STATE_AUTH_REQUIRED: "auth required",
    TASK_STATE_COMPLETED: "completed", TASK_STATE_FAILED: "failed",
    TASK_STATE_CANCELED: "canceled", TASK_STATE_REJECTED: "rejected",
  };
  function setBadge(st) {
    if (!st) return;
    const badge = document.querySelector("#state-badge .badge");
    if (!badge || badge.dataset.state === st) return;
    badge.dataset.state = st;
    badge.className = "badge st-" + st.replace("TASK_STATE_", "").toLowerCase().replace(/_/g, "-");
    badge.textContent = LABELS[st] || st;
  }

  // --- artifacts: one block per artifactId, growing in place
  const pendingChunks = new Map(); // artifactId -> [{seq, text}]
  const dirtyArtifacts = new Set();
  function findArtifact(id) {
    for (const el of artifactsBox.querySelectorAll("article.artifact")) {
      if (el.dataset.artifactId === id) return el;
    }
    return null;
  }
  function pendingPre(block) {
    let pre = block.querySelector("pre.pending");
    if (!pre) {
      pre = document.createElement("pre");
      pre.className = "pending";
      const body = block.querySelector(".artifact-body") || block;
      body.appendChild(pre);
    }
    return pre;
  }
  function applyArtifactEvent(ev) {
    const update = ev.raw && ev.raw.artifactUpdate;
    if (!update || !update.artifact) return;
    const art = update.artifact;
    const id = String(art.artifactId || "");
    let block = findArtifact(id);
    if (!block) {
      block = document.createElement("article");
      block.className = "artifact";
      block.dataset.artifactId = id;
      block.dataset.seq = "0";
      const head = document.createElement("header");
      head.className = "artifact-head";
      const h = document.createElement("h3");
      h.textContent = art.name || id;
      head.appendChild(h);
      const body = document.createElement("div");
      body.className = "artifact-body";
      block.append(head, body);
      artifactsBox.appendChild(block);
      document.getElementById("no-artifacts").hidden = true;
    }
    dirtyArtifacts.add(id);
    // The server's rendering shown may already include this chunk (it can be newer
    // than the events received so far, e.g. while catching up after a reconnect).
    if (ev.seq <= parseInt(block.dataset.seq || "0", 10)) return;
    const texts = (art.parts || []).filter((p) => p && typeof p.text === "string").map((p) => p.text);
    let chunks = pendingChunks.get(id) || [];
    if (!update.append) {
      // A replacement: what was shown is superseded.
      chunks = [];
      const body = block.querySelector(".artifact-body");
      if (body) body.textContent = "";
    }
    if (texts.length) {
      chunks.push({ seq: ev.seq, text: texts.join("") });
      pendingPre(block).textContent += texts.join("");
    }
    pendingChunks.set(id, chunks);
  }
  function redrawArtifact(item) {
    const block = findArtifact(item.artifact_id);
    const tmp = document.createElement("div");
    tmp.innerHTML = item.html; // server-rendered and sanitized (tasks_app/rendering.py)
    const fresh = tmp.firstElementChild;
    if (!fresh) return;
    if (!block) { artifactsBox.appendChild(fresh); document.getElementById("no-artifacts").hidden = true; return; }
    if (parseInt(block.dataset.seq || "0", 10) > item.updated_seq) return; // older than shown
    // Redraw in place: same element, new content.
    block.innerHTML = fresh.innerHTML;
    block.id = fresh.id;
    block.dataset.seq = String(item.updated_seq);
    const rest = (pendingChunks.get(item.artifact_id) || []).filter((c) => c.seq > item.updated_seq);
    pendingChunks.set(item.artifact_id, rest);
    if (rest.length) pendingPre(block).textContent = rest.map((c) => c.text).join("");
  }

  // --- the rest of the page: server fragments, throttled
  function replaceKeepingScroll(el, html) {
    if (!el || el.dataset.html === html) return;
    const follow = Live.atBottom(el);
    const top = el.scrollTop;
    el.innerHTML = html;
    el.dataset.html = html;
    el.scrollTop = follow ? el.scrollHeight : top;
  }
  // What a person typed into the answer form, to keep in view when the form goes (someone
  // else answered, or the agent asked something else): replaced silently, it was lost.
  let typedInAnswer = false;
  document.addEventListener("input", (ev) => {
    if (ev.target && ev.target.closest && ev.target.closest("#answer-form")) typedInAnswer = true;
  });
  function typedAnswer(current) {
    const form = current && current.querySelector("#answer-form");
    if (!form || !typedInAnswer) return "";
    const fields = form.querySelectorAll("textarea, input[type=text], input[type=number], input[type=date], input[type=datetime-local], input[type=email], input[type=url]");
    const filled = Array.from(fields).filter((el) => el.value.trim());
    return filled.map((el) => {
      const label = el.id ? form.querySelector('label[for="' + el.id + '"]') : null;
      const name = label ? label.textContent.replace("*", "").trim() : "";
      return (name && filled.length > 1 ? name + ": " : "") + el.value;
    }).join("\n");
  }
  function keepTyped(box, typed, questionBefore) {
    const form = box.querySelector("#answer-form");
    if (!typed || (form && form.dataset.question === questionBefore)) return;
    const kept = document.createElement("div");
    kept.className = "kept-answer-box";
    kept.setAttribute("role", "status");
    const note = document.createElement("p");
    note.className = "bad small";
    note.textContent = (form ? "The agent asked something else" : "The question was answered or ended") +
      " while you were typing: your answer was not sent. What you typed:";
    const text = document.createElement("textarea");
    text.id = "kept-answer";
    text.readOnly = true;
    text.rows = 3;
    text.value = typed;
    text.setAttribute("aria-label", "Your answer, not sent");
    kept.append(note, text);
    (box.querySelector(".task-actions") || box).prepend(kept);
    typedInAnswer = false;
  }
  function replaceActions(html) {
    const box = document.getElementById("task-actions");
    const tmp = document.createElement("div");
    tmp.innerHTML = html;
    const fresh = tmp.querySelector(".task-actions");
    const current = box.querySelector(".task-actions");
    // The push panel's "follow by ... instead" (templates/tasks_app/_push_configs.html) is an
    // action too: gone with the others once the task ended, was abandoned or is gone.
    const pushSwitch = document.getElementById("push-switch");
    if (pushSwitch && fresh && !fresh.dataset.pushSwitch) pushSwitch.remove();
    if (fresh && current && fresh.dataset.key === current.dataset.key) return; // keep what is typed
    const typed = typedAnswer(current);
    const before = current && current.querySelector("#answer-form");
    const kept = current && current.querySelector(".kept-answer-box");
    box.innerHTML = html;
    if (kept && !typed) (box.querySelector(".task-actions") || box).prepend(kept);
    keepTyped(box, typed, before ? before.dataset.question : "");
  }
  // A snapshot (a polled agent's Task), a gap or the end can change any artifact without an
  // artifactUpdate event: then every artifact block is redrawn from the server.
  let allArtifacts = false;
  const refresh = Live.throttle(async function () {
    const params = new URLSearchParams();
    dirtyArtifacts.forEach((id) => params.append("artifact", id));
    dirtyArtifacts.clear();
    if (allArtifacts) params.set("all_artifacts", "1");
    allArtifacts = false;
    const resp = await fetch(liveUrl + "?" + params.toString(), { headers: { Accept: "application/json" }, credentials: "same-origin" });
    if (!resp.ok) return;
    const data = await resp.json();
    const html = data.html;
    document.getElementById("task-head").innerHTML = html.head;
    replaceKeepingScroll(document.getElementById("task-watch"), html.watch);
    replaceKeepingScroll(document.getElementById("task-status"), html.status);
    replaceKeepingScroll(convBox, html.conversation);
    replaceKeepingScroll(document.getElementById("timeline"), html.timeline);
    replaceActions(html.actions);
    data.artifacts.forEach(redrawArtifact);
    Live.tickTimes();
  }, 250);

  // --- applying events
  function apply(ev) {
    if (ev.seq <= state.lastSeq) { state.duplicates += 1; return; }
    if (ev.seq !== state.lastSeq + 1) {
      // Never show a hole: resume from what we have.
      state.gaps += 1;
      state.socket.reconnectNow();
      return;
    }
    state.lastSeq = ev.seq;
    state.seqs.push(ev.seq);
    updateChain();
    pendingRows.push(eventRow(ev));
    if (!frame) frame = requestAnimationFrame(flushRows);
    setBadge(ev.state);
    // A row sent without its JSON (too long) cannot be applied here: the server redraws.
    if (ev.kind === "artifactUpdate" && !ev.raw_cut) applyArtifactEvent(ev);
    else if (ev.raw_cut || ev.kind === "task" || ev.kind === "gap" || TERMINAL.includes(ev.state)) allArtifacts = true;
    refresh();
    // Other parts of the page (A2UI surfaces: a2ui.js) follow the same events.
    document.dispatchEvent(new CustomEvent("task:event", { detail: ev }));
  }

  // A (re)connect resumes after lastSeq; when idle we ask for rows after it too,
  // so a lost relay of the task's last event is repaired within seconds. Fragments
  // are fetched again only after a (re)connect or when an event was applied.
  state.socket = new Live.LiveSocket("/ws/tasks/" + taskPk + "/", {
    query: () => "?after=" + state.lastSeq,
    onOpen: () => { state.synced = false; },
    onIdle: () => state.socket.send({ type: "sync", after: state.lastSeq }),
    onMessage: (msg) => {
      if (msg.type === "event") apply(msg);
      else if (msg.type === "gap") {
        // The log itself has a hole there (the server says so and sends what follows):
        // taken as it is, or every resume would meet it again and reconnect for ever.
        if (msg.after === state.lastSeq && msg.next > state.lastSeq) {
          state.lastSeq = msg.next - 1;
          state.holes += 1;
          updateChain();
        }
      } else if (msg.type === "reload") {
        // Too far behind to catch up row by row (consumers.RESUME_MAX_ROWS): the page
        // loads again, with the newest rows, and resumes after them.
        state.reloading = true;
        window.location.reload();
      } else if (msg.type === "synced") {
        if (!state.synced) { refresh(); document.dispatchEvent(new CustomEvent("task:synced")); }
        state.synced = true;
        state.socket.status("open", "up to date");
      } else if (msg.type === "watcher") refresh();
    },
  });
  state.dropSocket = (holdMs) => state.socket.drop(holdMs);
  updateChain(); // rows the page was rendered with beyond what the sentence counted

  if (logBox) logBox.scrollTop = logBox.scrollHeight;
  if (convBox) convBox.scrollTop = convBox.scrollHeight;
})();
