/* A2UI surfaces drawn by the server (tasks_app/a2ui_render.py), made live. No agent code runs
 * here: the agent's JSON only arrives as data attributes the server escaped, read with
 * JSON.parse, and every value is put into the page with textContent.
 *
 * - Inputs write their value into the surface's data model (data-a2ui-model) at their binding
 *   (data-a2ui-path); elements bound to that path (data-a2ui-bind) show it at once.
 * - The catalog's validation functions (data-a2ui-checks) run as the person types: messages
 *   next to the input, a Button whose checks fail is disabled, a form with failing checks is
 *   not sent. The server checks again on submit.
 * - Tabs and Modal behave (the page works without this script: every tab panel is shown,
 *   a Modal is a <details>).
 * - On the task page, events of the task's websocket (task.js) that carry A2UI make the
 *   surfaces be fetched again from the server and swapped in where they changed, keeping what
 *   the person typed, the Modals they opened and the tabs they chose.
 */
(function () {
  "use strict";
  const models = new WeakMap();

  // --- JSON Pointer, as the server reads it
  function tokens(path) {
    if (!path || path === "/") return [];
    return path.replace(/^\//, "").split("/").map((t) => t.replace(/~1/g, "/").replace(/~0/g, "~"));
  }
  function lookup(model, path) {
    let node = model;
    for (const t of tokens(path)) {
      if (node === null || typeof node !== "object") return undefined;
      if (Array.isArray(node)) { if (!/^\d+$/.test(t)) return undefined; node = node[parseInt(t, 10)]; }
      else { if (!Object.prototype.hasOwnProperty.call(node, t)) return undefined; node = node[t]; }
    }
    return node;
  }
  function assign(model, path, value) {
    const toks = tokens(path);
    if (!toks.length) return;
    let node = model;
    for (const t of toks.slice(0, -1)) {
      if (Array.isArray(node) && /^\d+$/.test(t) && parseInt(t, 10) < node.length) { node = node[parseInt(t, 10)]; continue; }
      if (node === null || typeof node !== "object" || Array.isArray(node)) return;
      if (!Object.prototype.hasOwnProperty.call(node, t) || node[t] === null || typeof node[t] !== "object") node[t] = {};
      node = node[t];
    }
    const last = toks[toks.length - 1];
    if (Array.isArray(node)) { if (/^\d+$/.test(last)) node[parseInt(last, 10)] = value; }
    else if (node && typeof node === "object") node[last] = value;
  }
  function display(v) {
    if (v === undefined || v === null) return "";
    if (typeof v === "boolean") return v ? "true" : "false";
    if (typeof v === "object") return JSON.stringify(v);
    return String(v);
  }

  // --- the catalog's validation functions (the subset a check uses)
  function evaluate(v, model, depth) {
    if ((depth || 0) > 16) return undefined;
    if (v && typeof v === "object" && !Array.isArray(v)) {
      if ("path" in v && !("call" in v)) return lookup(model, v.path);
      if (typeof v.call === "string") return call(v, model, (depth || 0) + 1);
    }
    return v;
  }
  function num(v) {
    if (v === null || v === undefined || v === "" || typeof v === "boolean") return null;
    const n = Number(v);
    return Number.isFinite(n) ? n : null;
  }
  const KNOWN = ["required", "regex", "length", "numeric", "email", "and", "or", "not"];
  // The agent's pattern runs here only when it cannot backtrack for long; otherwise the check
  // passes here and the agent decides. The server's rule (a2ui_render.usable_pattern): short, no quantified group, no
  // back-reference or look-around, at most two quantifiers (one past 300 characters of
  // value), values up to 2,000 characters. Any other pattern is not run (counts as met).
  function usablePattern(pattern, chars) {
    if (typeof pattern !== "string" || pattern.length > 100 || /\)\s*[*+?{]/.test(pattern)) return false;
    if (/\\[1-9]|\(\?P=|\(\?<?[=!]/.test(pattern)) return false;
    const bare = pattern.replace(/\\.|\[(?:\\.|[^\]\\])*\]/g, "x").split("(?").join("(");
    const repeats = (bare.match(/[*+?{]/g) || []).length;
    return !(repeats > 2 || (repeats === 2 && chars > 300) || chars > 2000);
  }
  function patternTest(pattern, value) {
    if (!usablePattern(pattern, value.length)) return true;
    try { return new RegExp(pattern).test(value); } catch (e) { return true; }
  }
  function call(fn, model, depth) {
    const a = fn.args && typeof fn.args === "object" ? fn.args : {};
    const arg = (k) => evaluate(a[k], model, depth);
    switch (fn.call) {
      case "required": { const v = arg("value"); return !(v === undefined || v === null || v === "" || (Array.isArray(v) && !v.length)); }
      case "regex": return patternTest(a.pattern, display(arg("value")));
      case "length": {
        const v = arg("value"); const n = (Array.isArray(v) ? v : display(v)).length;
        const lo = num(arg("min")), hi = num(arg("max"));
        return (lo === null || n >= lo) && (hi === null || n <= hi);
      }
      case "numeric": {
        const v = num(arg("value")), lo = num(arg("min")), hi = num(arg("max"));
        return v !== null && (lo === null || v >= lo) && (hi === null || v <= hi);
      }
      case "email": { const v = arg("value"); return typeof v === "string" && /^[^@\s]+@[^@\s.]+(\.[^@\s.]+)+$/.test(v); }
      case "and": return (Array.isArray(a.values) ? a.values : []).every((x) => !!evaluate(x, model, depth));
      case "or": return (Array.isArray(a.values) ? a.values : []).some((x) => !!evaluate(x, model, depth));
      case "not": return !arg("value");
      default: return true;
    }
  }
  function failures(el, model) {
    let checks;
    try { checks = JSON.parse(el.dataset.a2uiChecks || "[]"); } catch (e) { return []; }
    if (!Array.isArray(checks)) return [];
    const out = [];
    checks.forEach((rule) => {
      if (!rule || typeof rule !== "object") return;
      const cond = "condition" in rule ? rule.condition : ("call" in rule ? rule : true);
      if (cond && typeof cond === "object" && typeof cond.call === "string" && !KNOWN.includes(cond.call)) return;
      if (!evaluate(cond, model)) out.push(String(rule.message || "This value is not valid."));
    });
    const pattern = el.dataset.a2uiPattern;
    if (pattern) {
      const input = el.querySelector("[data-a2ui-path]");
      const v = input ? input.value : "";
      if (v && !patternTest(pattern, v)) out.push("This value does not have the expected form.");
    }
    return out;
  }

  // --- one surface
  function modelOf(surface) {
    if (!models.has(surface)) {
      let m = {};
      try { m = JSON.parse(surface.dataset.a2uiModel || "{}"); } catch (e) { m = {}; }
      models.set(surface, m && typeof m === "object" ? m : {});
    }
    return models.get(surface);
  }
  function valueOf(el) {
    if (el.matches("fieldset")) {
      return Array.from(el.querySelectorAll("input:checked")).map((i) => i.value);
    }
    if (el.type === "checkbox") return el.checked;
    if (el.type === "range") return num(el.value);
    return el.value;
  }
  function bound(el) { return el.matches("[data-a2ui-path]") ? el : el.closest("[data-a2ui-path]"); }

  function showBound(surface, path, value, source) {
    surface.querySelectorAll("[data-a2ui-bind]").forEach((el) => {
      if (el.dataset.a2uiBind === path) el.textContent = display(value);
    });
    surface.querySelectorAll("[data-a2ui-path]").forEach((el) => {
      if (el === source || el.dataset.a2uiPath !== path) return;
      if (el.matches("fieldset")) {
        const vals = Array.isArray(value) ? value.map(String) : [];
        el.querySelectorAll("input").forEach((i) => { i.checked = vals.includes(i.value); });
      } else if (el.type === "checkbox") el.checked = value === true;
      else el.value = display(value);
    });
  }

  let whyCount = 0;
  function check(surface, showAll) {
    const model = modelOf(surface);
    let ok = true;
    surface.querySelectorAll(".a2ui-field[data-a2ui-checks], .a2ui-field[data-a2ui-pattern]").forEach((field) => {
      const msgs = failures(field, model);
      if (msgs.length) ok = false;
      const input = field.matches("[data-a2ui-path]") ? field : field.querySelector("[data-a2ui-path]");
      const touched = showAll || (input && input.dataset.a2uiDirty === "1");
      const box = field.querySelector(".a2ui-errors");
      if (box && touched) box.textContent = msgs.join(" ");
      field.classList.toggle("a2ui-invalid", touched && msgs.length > 0);
    });
    surface.querySelectorAll("button.a2ui-button[data-a2ui-checks]").forEach((b) => {
      const msgs = failures(b, model);
      b.disabled = msgs.length > 0;
      b.title = msgs.join(" ");
      // Said beside it as well: a title shows to a mouse only, and keyboard and touch users
      // met a button that did nothing, with no reason given.
      let why = b.nextElementSibling;
      if (!why || !why.classList.contains("a2ui-button-why")) {
        why = document.createElement("span");
        why.className = "a2ui-button-why small muted";
        why.id = "a2ui-why-" + (++whyCount);
        b.after(why);
        b.setAttribute("aria-describedby", why.id);
      }
      why.textContent = msgs.join(" ");
    });
    return ok;
  }

  function onInput(ev) {
    const surface = ev.target.closest && ev.target.closest(".a2ui-surface");
    if (!surface) return;
    const el = bound(ev.target);
    if (!el) return;
    el.dataset.a2uiDirty = "1";
    const value = valueOf(el);
    const out = el.type === "range" && el.parentElement.querySelector(".a2ui-slider-value");
    if (out && !el.dataset.a2uiPath) out.textContent = display(value);
    if (el.dataset.a2uiPath) {
      assign(modelOf(surface), el.dataset.a2uiPath, value);
      showBound(surface, el.dataset.a2uiPath, value, el);
    }
    check(surface, false);
  }

  function upgrade(root) {
    (root || document).querySelectorAll(".a2ui-tabs:not(.a2ui-tabs-live)").forEach((tabs) => {
      tabs.classList.add("a2ui-tabs-live");
      const list = tabs.querySelector(".a2ui-tablist");
      if (list) list.hidden = false;
      const chosen = Number(tabs.dataset.a2uiChosen || 0);
      delete tabs.dataset.a2uiChosen;
      select(tabs, list && chosen < list.children.length ? chosen : 0);
    });
    (root || document).querySelectorAll(".a2ui-surface").forEach((s) => check(s, false));
  }
  function select(tabs, n) {
    const list = tabs.querySelector(":scope > .a2ui-tablist");
    const buttons = list ? Array.from(list.children) : [];
    const panels = Array.from(tabs.querySelectorAll(":scope > .a2ui-tabpanel"));
    buttons.forEach((b, i) => { b.setAttribute("aria-selected", i === n ? "true" : "false"); b.tabIndex = i === n ? 0 : -1; });
    panels.forEach((p, i) => { p.hidden = i !== n; });
  }

  document.addEventListener("input", onInput);
  document.addEventListener("change", onInput);
  document.addEventListener("click", (ev) => {
    const tab = ev.target.closest && ev.target.closest(".a2ui-tab");
    if (tab) {
      const tabs = tab.closest(".a2ui-tabs");
      select(tabs, Array.from(tab.parentElement.children).indexOf(tab));
      return;
    }
    const close = ev.target.closest && ev.target.closest(".a2ui-modal-close");
    if (close) close.closest("details.a2ui-modal").open = false;
  });
  document.addEventListener("keydown", (ev) => {
    if (ev.key === "Escape") document.querySelectorAll("details.a2ui-modal[open]").forEach((d) => { d.open = false; });
    const tab = ev.target.closest && ev.target.closest(".a2ui-tab");
    if (tab && (ev.key === "ArrowRight" || ev.key === "ArrowLeft")) {
      const all = Array.from(tab.parentElement.children);
      const n = (all.indexOf(tab) + (ev.key === "ArrowRight" ? 1 : all.length - 1)) % all.length;
      select(tab.closest(".a2ui-tabs"), n);
      all[n].focus();
      ev.preventDefault();
    }
  });
  // A page shown again from the back/forward cache may send again.
  window.addEventListener("pageshow", () => {
    document.querySelectorAll("form.a2ui-form[data-sending]").forEach((f) => { delete f.dataset.sending; });
  });
  document.addEventListener("submit", (ev) => {
    const form = ev.target.closest && ev.target.closest("form.a2ui-form");
    if (!form) return;
    const surface = form.closest(".a2ui-surface");
    if (!check(surface, true)) { ev.preventDefault(); return; }
    if (form.dataset.sending === "1") { ev.preventDefault(); return; }
    form.dataset.sending = "1"; // one press, one action
  });

  // --- live: swap in what the server draws now (task page)
  function carryTyped(old, fresh) {
    if (!fresh.querySelector("form.a2ui-form")) return; // submitted or read-only now
    old.querySelectorAll("[data-a2ui-dirty='1']").forEach((el) => {
      const path = el.dataset.a2uiPath;
      const twin = Array.from(fresh.querySelectorAll("[data-a2ui-path]")).find((f) => path && f.dataset.a2uiPath === path && f.tagName === el.tagName);
      if (!twin) return;
      const value = valueOf(el);
      if (twin.matches("fieldset")) twin.querySelectorAll("input").forEach((i) => { i.checked = (value || []).includes(i.value); });
      else if (twin.type === "checkbox") twin.checked = value === true;
      else twin.value = el.value;
      twin.dataset.a2uiDirty = "1";
      assign(modelOf(fresh), path, valueOf(twin));
      showBound(fresh, path, valueOf(twin), twin);
    });
  }
  // An open Modal and the chosen tab stay as the person left them (twins found by component
  // id and occurrence: a list's template repeats ids).
  function twins(old, fresh, selector) {
    const byId = new Map();
    fresh.querySelectorAll(selector).forEach((el) => {
      const id = el.dataset.a2uiId || "";
      if (!byId.has(id)) byId.set(id, []);
      byId.get(id).push(el);
    });
    const seen = new Map();
    const pairs = [];
    old.querySelectorAll(selector).forEach((el) => {
      const id = el.dataset.a2uiId || "";
      const n = seen.get(id) || 0;
      seen.set(id, n + 1);
      const twin = (byId.get(id) || [])[n];
      if (twin) pairs.push([el, twin]);
    });
    return pairs;
  }
  function carryView(old, fresh) {
    twins(old, fresh, "details.a2ui-modal").forEach(([el, twin]) => { twin.open = el.open; });
    twins(old, fresh, ".a2ui-tabs").forEach(([el, twin]) => {
      const list = el.querySelector(":scope > .a2ui-tablist");
      const chosen = list ? Array.from(list.children).findIndex((b) => b.getAttribute("aria-selected") === "true") : -1;
      if (chosen > 0) twin.dataset.a2uiChosen = String(chosen);
    });
  }
  let timer = 0;
  let busy = false;
  let again = false;
  async function refresh() {
    const box = document.getElementById("a2ui-surfaces");
    if (!box || !box.dataset.url) return;
    if (busy) { again = true; return; }
    busy = true;
    try {
      const resp = await fetch(box.dataset.url, { credentials: "same-origin", headers: { Accept: "text/html" } });
      if (!resp.ok) return;
      const tmp = document.createElement("div");
      tmp.innerHTML = await resp.text(); // server-drawn, every agent string escaped
      const current = new Map();
      box.querySelectorAll(":scope > .a2ui-surface").forEach((el) => current.set(el.dataset.a2uiSurface, el));
      const next = [];
      tmp.querySelectorAll(":scope > .a2ui-surface").forEach((el) => {
        const old = current.get(el.dataset.a2uiSurface);
        if (old && old.dataset.a2uiKey === el.dataset.a2uiKey) { next.push(old); return; }
        if (old) { carryTyped(old, el); carryView(old, el); }
        next.push(el);
      });
      // Put in only what changed: taking out a surface kept as it was would take the focus
      // (and the keys being typed) from its input on every event that arrives.
      const kept = Array.from(box.children);
      const unchanged = next.length === kept.length && next.every((el, i) => kept[i] === el);
      if (!unchanged) {
        const focused = box.contains(document.activeElement) ? document.activeElement : null;
        box.replaceChildren(...next);
        if (focused && focused.isConnected) focused.focus();
      }
      upgrade(box);
      box.dataset.refreshed = String(Number(box.dataset.refreshed || 0) + 1);
    } finally {
      busy = false;
      if (again) { again = false; schedule(); }
    }
  }
  function schedule() {
    if (timer) return;
    timer = setTimeout(() => { timer = 0; refresh(); }, 200);
  }
  let lastState = null;
  document.addEventListener("task:event", (e) => {
    const ev = e.detail || {};
    const changed = ev.state && ev.state !== lastState;
    lastState = ev.state || lastState;
    let raw = "";
    try { raw = JSON.stringify(ev.raw || {}); } catch (err) { raw = ""; }
    if (changed || ev.raw_cut || ev.kind === "operator" || ev.kind === "task" || ev.kind === "gap" || raw.indexOf("a2ui") !== -1) schedule();
  });
  document.addEventListener("task:synced", schedule);
  window.A2UI = { refresh: schedule, upgrade: upgrade };

  // Rows the inbox inserts live are upgraded as they arrive.
  new MutationObserver((records) => {
    records.forEach((r) => r.addedNodes.forEach((n) => {
      if (n.nodeType === 1 && (n.matches(".a2ui-surface") || n.querySelector(".a2ui-surface"))) upgrade(n);
    }));
  }).observe(document.documentElement, { childList: true, subtree: true });
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", () => upgrade(document));
  else upgrade(document);
})();
