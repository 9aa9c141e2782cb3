/* A websocket that reconnects with backoff. Vanilla JS, no build step.
 *
 *   const live = new LiveSocket("/ws/tasks/1/", {
 *     query: () => "?after=" + lastSeq,   // asked again on every (re)connect
 *     onMessage: (msg) => ..., onStatus: (state) => ...,
 *     onIdle: () => live.send({type: "sync"}),  // re-sync: see below
 *   });
 *
 * Re-sync: a relay message can be lost, and nothing would tell us if it was
 * the last one. With onIdle, the socket calls it when nothing arrived for
 * idleMs (default 5 s), and every 6 idleMs anyway; the server answers every
 * sync, so a connection that stays silent for 4 idleMs in spite of them is
 * treated as dead and reconnected.
 *
 * Closed by the server with one of STOP_CODES, it does not connect again and says why
 * on the status line (connecting again would be refused the same way). Closed with
 * 4429 (more frames than the socket's budget, consumers.FRAME_BURST) or 4430 (the person
 * has too many sockets open, BUDGET_PERSON_SOCKETS), it waits BUSY_WAIT_MS to
 * twice that before connecting again, whatever its backoff.
 */
(function () {
  "use strict";

  function wsUrl(path) {
    const proto = window.location.protocol === "https:" ? "wss://" : "ws://";
    return proto + window.location.host + path;
  }

  // Close codes after which connecting again cannot help: not logged in, no such task (or
  // not readable), refused (another origin, or access denied: tasks_app/routing.py).
  const STOP_CODES = {
    4401: "log in again",
    4403: "refused by the server (not reconnecting)",
    4404: "not found",
  };
  const TOO_MANY_FRAMES = 4429;
  const TOO_MANY_SOCKETS = 4430;  // the person's open sockets (BUDGET_PERSON_SOCKETS)
  const BUSY_WAIT_MS = 30000;

  /* The page's "live:" line (tests wait for data-state=open). */
  function showStatus(state, text) {
    const el = document.getElementById("live-status");
    if (el) {
      el.dataset.state = state;
      el.textContent = "live: " + (text || state);
    }
  }

  class LiveSocket {
    constructor(path, options) {
      this.path = path;
      this.options = options || {};
      this.attempt = 0;
      this.ws = null;
      this.holdUntil = 0;
      this.stopped = false;
      this.timer = null;
      this.heardAt = 0;
      this.pokedAt = 0;
      if (this.options.onIdle) setInterval(() => this.checkIdle(), 1000);
      this.connect();
    }

    checkIdle() {
      const ws = this.ws;
      if (!ws || ws.readyState !== WebSocket.OPEN) return;
      const idle = this.options.idleMs || 5000;
      const now = Date.now();
      if (this.pokedAt > this.heardAt && now - this.heardAt > 4 * idle) {
        this.reconnectNow(); // asked again and again, never answered
        return;
      }
      if (now - Math.max(this.heardAt, this.pokedAt) >= idle || now - this.pokedAt >= 6 * idle) {
        this.pokedAt = now;
        this.options.onIdle();
      }
    }

    status(state, text) {
      if (this.options.onStatus) this.options.onStatus(state, text);
      showStatus(state, text);
    }

    connect() {
      if (this.stopped) return;
      const wait = this.holdUntil - Date.now();
      if (wait > 0) {
        this.timer = setTimeout(() => this.connect(), wait);
        return;
      }
      const query = this.options.query ? this.options.query() : "";
      const ws = new WebSocket(wsUrl(this.path + query));
      this.ws = ws;
      this.status("connecting", "connecting…");
      ws.onopen = () => {
        this.attempt = 0;
        this.heardAt = Date.now();
        this.status("open", "connected");
        if (this.options.onOpen) this.options.onOpen(ws);
      };
      ws.onmessage = (ev) => {
        this.heardAt = Date.now();
        let msg;
        try { msg = JSON.parse(ev.data); } catch (e) { return; }
        if (this.options.onMessage) this.options.onMessage(msg);
      };
      ws.onclose = (ev) => {
        if (this.ws !== ws) return;
        this.ws = null;
        if (this.stopped) return;
        if (Object.prototype.hasOwnProperty.call(STOP_CODES, ev.code)) {
          this.status("closed", STOP_CODES[ev.code]);
          return;
        }
        this.attempt += 1;
        const base = Math.min(10000, 400 * Math.pow(2, this.attempt - 1));
        let delay = base / 2 + Math.random() * base / 2;
        let why = "reconnecting in ";
        if (ev.code === TOO_MANY_FRAMES) {
          delay = BUSY_WAIT_MS + Math.random() * BUSY_WAIT_MS;
          why = "too many requests, reconnecting in ";
        } else if (ev.code === TOO_MANY_SOCKETS) {
          delay = BUSY_WAIT_MS + Math.random() * BUSY_WAIT_MS;
          why = "too many live pages open (close some), reconnecting in ";
        }
        this.status("reconnecting", why + Math.round(delay / 100) / 10 + " s");
        this.timer = setTimeout(() => this.connect(), delay);
      };
      ws.onerror = () => { /* onclose follows */ };
    }

    /* Drop the connection as if the network failed (tests use it); the
       reconnect waits at least holdMs. */
    drop(holdMs) {
      this.holdUntil = Date.now() + (holdMs || 0);
      if (this.ws) this.ws.close();
    }

    reconnectNow() {
      if (this.ws) this.ws.close();
    }

    send(obj) {
      if (this.ws && this.ws.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify(obj));
    }
  }

  /* Run fn at most once per `ms`, and once more after the last call. */
  function throttle(fn, ms) {
    let last = 0, timer = null, running = false, again = false;
    async function run() {
      timer = null;
      if (running) { again = true; return; }
      running = true;
      last = Date.now();
      try { await fn(); } catch (e) { console.warn(e); }
      running = false;
      if (again) { again = false; schedule(); }
    }
    function schedule() {
      if (timer) return;
      const wait = Math.max(0, ms - (Date.now() - last));
      timer = setTimeout(run, wait);
    }
    return schedule;
  }

  /* True when a scroll box is (nearly) scrolled to its end. */
  function atBottom(el) {
    return el.scrollHeight - el.scrollTop - el.clientHeight < 24;
  }

  function ago(iso) {
    if (!iso) return "";
    const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
    if (s < 60) return Math.floor(s) + " s ago";
    if (s < 3600) return Math.floor(s / 60) + " min ago";
    if (s < 86400) return Math.floor(s / 3600) + " h ago";
    return Math.floor(s / 86400) + " d ago";
  }

  function tickTimes() {
    document.querySelectorAll("time.live-ago").forEach((t) => {
      t.textContent = ago(t.getAttribute("datetime"));
    });
  }
  setInterval(tickTimes, 1000);

  /* The task-list socket with re-sync by version (see TaskListConsumer): the
   * newest updated_at known (the page's render time at first); after a
   * (re)connect and when idle it asks for the tasks changed since then (an
   * answer cut at its limit says "more": the rest is asked for at once).
   * onTask gets every task summary; version() says where the list stands. SocketClass:
   * a LiveSocket subclass, e.g. one that reports its status elsewhere (the inbox badge). */
  function taskListSocket(renderedAt, onTask, SocketClass = LiveSocket) {
    let version = Date.parse(renderedAt || "") || 0;
    const newer = (iso) => { version = Math.max(version, Date.parse(iso || "") || 0); };
    const sync = () => socket.send({ type: "sync", since: version ? new Date(version).toISOString() : null });
    const socket = new SocketClass("/ws/tasks/", {
      onOpen: sync,
      onIdle: sync,
      onMessage: (msg) => {
        if (msg.type === "version") {
          newer(msg.version);
          // More changed than one answer holds: the rest, at once, from where it stopped
          // (the server's own version text: this page keeps only milliseconds).
          if (msg.more) socket.send({ type: "sync", since: msg.version, after: msg.more });
        }
        if (msg.type !== "task") return;
        newer(msg.updated_at);
        onTask(msg);
      },
    });
    return { socket, version: () => version };
  }

  /* "2026-11-30 12:54:20.123 UTC" from the server's ISO time (always UTC, as the pages). */
  function fullTime(iso) {
    const d = new Date(iso || "");
    if (isNaN(d)) return "";
    return d.toISOString().replace("T", " ").slice(0, 23) + " UTC";
  }

  /* The page's feed of task summaries: the inbox badge's list socket when the page has
   * the badge (one list socket per page, not two), else a socket of its own. Either way
   * the page's "live:" line shows the socket's state and onTask gets every summary. */
  function taskListFeed(renderedAt, onTask) {
    const badge = window.InboxBadge;
    if (!badge) return taskListSocket(renderedAt, onTask);
    badge.subscribe(onTask);
    badge.onStatus(showStatus);
    return { socket: badge.socket, version: badge.version };
  }

  window.Live = { LiveSocket, taskListSocket, taskListFeed, throttle, atBottom, ago, tickTimes, fullTime };
})();
