"""The dashboard in headless Chromium against the real stack.

A live daphne server and a real Celery worker run as subprocesses on a private
SQLite file (migrated here, so the module needs no pytest-django database), the
session's Redis database (``redis_url`` from ``tests.infra``) and a private Celery queue; the
demo A2A agent is the real peer (``tests.agents``). The test process reads the
log straight from the SQLite file to compare it with what the page shows.

Screenshots of the main pages go to ``test-artifacts/screenshots/``.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.agents import REPO_ROOT
from tests.serving import serve_in_thread, stop_serving
from tests.ui_stack import Stack, chromium, running_stack

# The stack (tests/ui_stack.py): migrate and a login made by commands, daphne, a Celery worker.
pytestmark = [
    pytest.mark.browser, pytest.mark.server, pytest.mark.worker, pytest.mark.subprocess,
    pytest.mark.slow, pytest.mark.timeout(240),
]  # fmt: skip

SHOTS = REPO_ROOT / "test-artifacts" / "screenshots"
USERNAME, PASSWORD = "operator", "op-password-123"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_url) -> Iterator[Stack]:
    with running_stack(
        tmp_path_factory.mktemp("ui"), redis_url, name="ui", username=USERNAME, password=PASSWORD,
        WATCH_POLL_MIN_SECONDS="0.3", WATCH_POLL_MAX_SECONDS="2",
    ) as running:  # fmt: skip
        yield running


@pytest.fixture(scope="module")
def browser(stack):
    """Headless Chromium (a missing one fails the module's tests with what to install)."""
    with chromium() as running:
        yield running


@pytest.fixture(scope="module")
def context(browser, stack):
    ctx = browser.new_context(base_url=stack.base_url, viewport={"width": 1280, "height": 900})
    ctx.set_default_timeout(15_000)
    page = ctx.new_page()
    page.goto("/tasks/")
    assert "/accounts/login/" in page.url  # everything needs a login
    page.fill("#id_username", USERNAME)
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r"/tasks/$"))
    page.close()
    yield ctx
    ctx.close()


@pytest.fixture
def page(context):
    p = context.new_page()
    yield p
    p.close()


class _HostEcho(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path != "/":  # the browser's own /favicon.ico
            self.send_error(404)
            return
        self.server.hosts.append(self.headers["Host"])  # type: ignore[attr-defined]
        body = f"reached {self.headers['Host']}".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _HostEcho6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def test_chromium_resolves_no_name_but_localhost() -> None:
    """CHROMIUM_ARGS keep the browser on loopback: 127.0.0.1, [::1] and localhost load, any
    other name resolves to nothing. The names tried are ones Chromium would otherwise send to
    loopback itself (``*.localhost``) or find in /etc/hosts' loopback lines, never a DNS
    server, so a broken flag could not send a packet off this machine either."""
    v4 = ThreadingHTTPServer(("127.0.0.1", 0), _HostEcho)
    v6 = _HostEcho6(("::1", 0, 0, 0), _HostEcho)
    for server in (v4, v6):
        server.hosts = []  # type: ignore[attr-defined]
        serve_in_thread(server)
    port4, port6 = v4.server_address[1], v6.server_address[1]
    local_hosts = [socket.gethostname()] if _on_loopback(socket.gethostname()) else []
    try:
        with chromium() as browser:
            page = browser.new_page()
            for host, port in (("127.0.0.1", port4), ("localhost", port4), ("[::1]", port6)):
                page.goto(f"http://{host}:{port}/", timeout=15_000)
                assert page.inner_text("body") == f"reached {host}:{port}"
            for name in ["dash.localhost", *local_hosts]:
                with pytest.raises(Exception, match="ERR_NAME_NOT_RESOLVED"):
                    page.goto(f"http://{name}:{port4}/", timeout=15_000)
    finally:
        stop_serving(v4)
        stop_serving(v6)
    assert v4.hosts == [f"127.0.0.1:{port4}", f"localhost:{port4}"]  # type: ignore[attr-defined]
    assert v6.hosts == [f"[::1]:{port6}"]  # type: ignore[attr-defined]


def _on_loopback(name: str) -> bool:
    """Whether /etc/hosts maps ``name`` to a loopback address (read here: no lookup)."""
    try:
        lines = open("/etc/hosts", encoding="utf-8").read().splitlines()  # noqa: SIM115
    except OSError:
        return False
    for line in lines:
        address, *names = line.split("#", 1)[0].split() or [""]
        if name in names and (address.startswith("127.") or address == "::1"):
            return True
    return False


def shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def task_pk_of(page) -> int:
    return int(re.search(r"/tasks/(\d+)/", page.url).group(1))


def start_task(page, text: str, mode: str = "auto") -> int:
    page.goto("/tasks/new")
    page.fill("#id_text", text)
    page.select_option("#id_mode", mode)
    page.click("#start-task")
    page.wait_for_url(re.compile(r"/tasks/\d+/$"))
    return task_pk_of(page)


def wait_state(page, label: str, timeout: float = 20_000) -> None:
    page.wait_for_selector(f"#state-badge .badge:text-is('{label}')", timeout=timeout)


@pytest.fixture(scope="module")
def demo_agent_pk(context, agent, stack) -> int:
    """Add the demo agent through the UI: preview first, then save."""
    page = context.new_page()
    page.goto("/agents/add/")
    page.fill("#id_url", agent.base_url)
    page.click("button[value=preview]")
    page.wait_for_selector("#card-preview")
    assert "The card is valid." in page.inner_text("#card-preview")
    assert stack.query("SELECT count(*) FROM tasks_app_agent")[0][0] == 0
    shot(page, "agent-add-preview")
    page.click("#save-agent")
    page.wait_for_url(re.compile(r"/agents/\d+/$"))
    pk = int(re.search(r"/agents/(\d+)/", page.url).group(1))
    assert "Skills" in page.inner_text("main")
    assert page.inner_text("#credentials-status") == "not set"
    shot(page, "agent-detail")
    page.goto("/agents/")
    shot(page, "agents")
    page.close()
    return pk


def test_slow_task_grows_live_and_resumes_after_a_dropped_socket(page, stack, demo_agent_pk):
    page.goto("/tasks/new")
    shot(page, "new-task")
    pk = start_task(page, "slow 12 0.4")
    # The artifact appears and grows in place: always one block, never shrinking.
    page.wait_for_selector("#artifacts article.artifact", timeout=20_000)
    samples: list[tuple[int, int]] = []
    dropped = False
    saw_progress = False
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        blocks, length, conv = page.evaluate(
            """() => [document.querySelectorAll('#artifacts article.artifact').length,
                      (document.querySelector('#artifacts article.artifact .artifact-body') || {textContent: ''}).textContent.length,
                      document.getElementById('conversation').textContent]"""
        )
        samples.append((blocks, length))
        saw_progress = saw_progress or bool(re.search(r"step \d+/12", conv))
        if not dropped and "chunk 4" in page.inner_text("#artifacts"):
            # Kill the websocket; keep it down for a while so events are missed.
            page.evaluate("window.__taskPage.dropSocket(1500)")
            dropped = True
        if stack.state(pk) == "TASK_STATE_COMPLETED" and "finished 12 steps" in conv:
            break
        page.wait_for_timeout(100)
    assert dropped and saw_progress
    assert all(blocks == 1 for blocks, _ in samples)
    lengths = [n for _, n in samples]
    assert lengths == sorted(lengths), lengths  # grows, never shrinks
    assert len(set(lengths)) >= 4, lengths  # seen growing several times, live
    wait_state(page, "completed")
    # The page holds exactly the log: every seq once, in order.
    db_seqs = stack.settled_seqs(pk)
    page.wait_for_function(f"() => window.__taskPage.lastSeq >= {db_seqs[-1]}")
    page.wait_for_timeout(300)
    state = page.evaluate(
        "({seqs: window.__taskPage.seqs, dup: window.__taskPage.duplicates, gaps: window.__taskPage.gaps})"
    )
    rows = [
        int(s)
        for s in page.eval_on_selector_all(
            "#event-rows tr[data-seq]", "rs => rs.map(r => r.dataset.seq)"
        )
    ]
    assert state["seqs"] == db_seqs
    assert rows == db_seqs
    assert state["gaps"] == 0
    text = page.inner_text("#artifacts article.artifact .artifact-body")
    assert [int(n) for n in re.findall(r"chunk (\d+)", text)] == list(range(1, 13))
    assert page.locator("#artifacts article.artifact").count() == 1
    assert page.locator("#timeline svg rect.st-completed").count() == 1
    shot(page, "task-page")


def test_cancel_a_long_task(page, stack, demo_agent_pk):
    pk = start_task(page, "long 60")
    wait_state(page, "working")
    page.click("#cancel-open")
    page.fill("#id_reason", "not needed any more")
    page.click("#cancel-confirm")
    page.wait_for_url(re.compile(rf"/tasks/{pk}/$"))
    wait_state(page, "canceled")
    assert stack.state(pk) == "TASK_STATE_CANCELED"
    assert "Cancel requested." in page.inner_text(".flash")
    assert page.locator("#cancel-open").count() == 0


def test_ask_then_answer(page, stack, demo_agent_pk):
    pk = start_task(page, "ask")
    wait_state(page, "input required")
    page.wait_for_selector("#answer-form")
    assert "What is your name?" in page.inner_text("#task-status")
    page.fill("#answer-form textarea", "Ada")
    page.click("#answer-form button[type=submit]")
    wait_state(page, "completed")
    page.wait_for_function(
        "() => document.getElementById('artifacts').textContent.includes('You answered: Ada')"
    )
    assert stack.state(pk) == "TASK_STATE_COMPLETED"


def test_untrusted_markdown_and_files(page, stack, demo_agent_pk):
    start_task(page, "markdown")
    wait_state(page, "completed")
    page.wait_for_selector("#artifacts a[href='https://example.org/']")
    assert page.locator("#artifacts script").count() == 0
    assert page.locator("#artifacts img").count() == 0
    assert page.locator("#artifacts [href^='javascript']").count() == 0
    assert (
        page.get_attribute("#artifacts a[href='https://example.org/']", "rel")
        == "noopener noreferrer"
    )
    assert "<script>alert('xss')</script>" in page.inner_text("#artifacts")  # shown as text
    start_task(page, "data")
    wait_state(page, "completed")
    page.wait_for_selector("#artifacts a.download")
    assert '"answer": 42' in page.inner_text("#artifacts pre.json")
    href = page.get_attribute("#artifacts a.download", "href")
    response = page.request.get(href)
    assert response.status == 200
    assert response.headers["content-disposition"] == 'attachment; filename="hello.txt"'
    assert response.body() == b"hello, file\n"


def test_task_list_is_live_and_filters(context, page, stack, demo_agent_pk):
    page.goto("/tasks/")
    page.wait_for_selector("#live-status[data-state=open]")
    other = context.new_page()
    pk = start_task(other, "quick live-list-check")
    # The new task appears in the open list without a reload, and its state follows.
    page.wait_for_selector(f"#task-row-{pk}")
    page.wait_for_selector(f"#task-row-{pk} .badge:text-is('completed')")
    # The count is the page load's, and says what arrived since (it stayed as it was).
    assert page.text_content("#task-count-since") == " when the page loaded (since then 1 arrived)"
    other.close()
    # Filter by state through the form: kept in the URL.
    page.select_option("#id_state", "TASK_STATE_COMPLETED")
    page.wait_for_url(re.compile(r"state=TASK_STATE_COMPLETED"))
    badges = page.eval_on_selector_all("#task-rows .badge", "bs => bs.map(b => b.textContent)")
    assert badges and set(badges) == {"completed"}
    page.goto("/tasks/?q=live-list-check")
    assert page.locator("#task-rows tr[data-task]").count() == 1
    page.goto("/tasks/")
    shot(page, "task-list")
    # On a phone the Task column keeps a readable width (it was 48 px, a letter a line); the
    # table scrolls in its box instead.
    page.set_viewport_size({"width": 390, "height": 844})
    try:
        page.goto("/tasks/")
        width = page.eval_on_selector(
            f"#task-row-{pk} td", "td => td.getBoundingClientRect().width"
        )
        assert width >= 120, width
        shot(page, "task-list-phone")
    finally:
        page.set_viewport_size({"width": 1280, "height": 900})
    page.goto("/")
    assert page.inner_text("#needs-input .num") == "0"
    shot(page, "overview")
    # Dark mode toggle and the narrow layout.
    page.click("#theme-toggle")
    page.set_viewport_size({"width": 420, "height": 900})
    shot(page, "overview-narrow-dark")


def test_list_pages_share_one_list_socket_with_the_inbox_badge(page, stack, demo_agent_pk):
    """The task list and the overview take their summaries from the badge's socket: one
    list socket per page, not two (each socket is a connection, and a copy of every summary)."""
    for path in ("/tasks/", "/"):
        opened: list[str] = []

        def note(ws, opened=opened) -> None:
            opened.append(ws.url)

        page.on("websocket", note)
        try:
            page.goto(path)
            page.wait_for_selector("#inbox-badge[data-socket=open]", state="attached")
            if path == "/tasks/":  # the overview has no "live:" line
                page.wait_for_selector("#live-status[data-state=open]")
            page.wait_for_timeout(500)  # a second socket, if any, would be open by now
        finally:
            page.remove_listener("websocket", note)
        assert [url.split("/ws/")[-1] for url in opened] == ["tasks/"], (path, opened)


def test_a_polled_task_shows_its_artifacts_live(page, stack, demo_agent_pk):
    """Return-immediately: the task is polled (snapshots, no artifactUpdate events), and its
    artifact still appears and grows on the open page, and ends complete, with no reload."""
    pk = start_task(page, "slow 6 0.5", mode="return-immediately")
    page.evaluate("window.__sameDocument = true")
    page.wait_for_selector("#artifacts article.artifact", timeout=30_000)
    wait_state(page, "completed", timeout=30_000)
    page.wait_for_function(
        "() => document.querySelector('#artifacts article.artifact .artifact-body').textContent.includes('chunk 6')",
        timeout=15_000,
    )
    assert page.evaluate("window.__sameDocument === true")  # never reloaded
    assert page.query_selector("#artifacts .growing") is None  # not "receiving…" once ended
    assert page.is_hidden("#no-artifacts")
    assert stack.state(pk) == "TASK_STATE_COMPLETED"


def test_an_event_too_long_to_send_live_is_linked_and_its_artifact_drawn(
    page, stack, demo_agent_pk
):
    """A 100 KB artifact chunk streamed to an open page: the socket sends the row without its
    JSON (it sent events of up to 8 MB whole, into the page); the row says so and links to
    it, and the artifact is drawn from the server."""
    pk = start_task(page, "big 100 3")
    page.evaluate("window.__sameDocument = true")
    page.wait_for_selector("#live-status[data-state=open]")
    wait_state(page, "completed", timeout=30_000)
    page.wait_for_function(
        "() => (document.querySelector('#artifacts article.artifact .artifact-body') || "
        "{textContent: ''}).textContent.includes('BIG-START')",
        timeout=15_000,
    )
    seq = stack.query(
        "SELECT seq FROM tasks_app_taskevent WHERE task_id=? AND kind='artifactUpdate'", pk
    )[0][0]
    row = f"#event-rows tr[data-seq='{seq}']"
    assert "too long to show here" in page.text_content(f"{row} pre.json")
    assert page.get_attribute(f"{row} a", "href") == f"/tasks/{pk}/events/{seq}/"
    assert page.evaluate("window.__sameDocument === true")  # live, not reloaded


def test_long_unbreakable_text_never_widens_the_page(page, stack, demo_agent_pk):
    """A 3,000-character word in the message, title and conversation wraps inside its box."""
    page.set_viewport_size({"width": 1440, "height": 900})
    word = "W" * 3000
    pk = start_task(page, f"ask {word}")
    wait_state(page, "input required")
    page.fill("#id_text", word)  # echoed back by the agent in an artifact
    page.click("#answer-form button[type=submit]")
    wait_state(page, "completed")
    widths = {}
    for url in (f"/tasks/{pk}/", f"/tasks/{pk}/events/", f"/tasks/{pk}/events/1/", "/tasks/", "/"):
        page.goto(url)
        widths[url] = page.evaluate("document.documentElement.scrollWidth")
    assert all(w <= 1440 for w in widths.values()), widths


def test_a_filter_with_an_error_keeps_the_filter_bar_in_line(page, stack):
    """The bar aligned its fields' bottoms: a field with an error beneath its input had that
    input lifted above the others, and the buttons sat level with the error text."""
    page.goto("/tasks/?state=bogus&q=x")
    assert page.locator("#task-filters .has-error").count() == 1
    tops = page.evaluate(
        """() => [...document.querySelectorAll('#task-filters .field:not(.actions)')]
               .map(f => f.querySelector('input, select').getBoundingClientRect())
               .filter(r => r.width > 0)
               .map(r => [Math.round(r.top), Math.round(r.bottom)])"""
    )
    first_row = [t for t in tops if t[0] < tops[0][0] + 40]
    assert len(first_row) >= 3 and len({t[0] for t in first_row}) == 1, tops
    button = page.locator("#task-filters .field.actions .button").first.bounding_box()
    row_bottom = first_row[0][1]
    # The buttons sit on the inputs' line (within a few pixels of their bottom), not below.
    assert abs(button["y"] + button["height"] - row_bottom) <= 6, (button, first_row)
    shot(page, "task-list-filter-error")


def test_a_live_rows_raw_json_shows_direction_characters_as_escapes(
    context, page, stack, demo_agent_pk
):
    """A right-to-left override in an agent's event reversed the rest of the raw line of a
    row that arrived live (the page drew JSON.stringify's text as it was)."""
    pk = start_task(page, "ask")
    wait_state(page, "input required")
    other = context.new_page()  # answers, while this page only listens
    try:
        other.goto(f"/tasks/{pk}/")
        other.fill("#answer-form textarea", "\u202eRTL")
        other.click("#answer-form button[type=submit]")
        other.wait_for_url(re.compile(rf"/tasks/{pk}/$"))
    finally:
        other.close()
    wait_state(page, "completed")
    # The agent's artifact echoes the answer; on this page its row came over the socket.
    page.wait_for_function(
        "() => [...document.querySelectorAll('details.raw pre')].some("
        "e => e.textContent.includes('RTL') && e.textContent.includes('artifactUpdate'))"
    )
    raws = page.eval_on_selector_all("details.raw pre", "els => els.map(e => e.textContent)")
    echoed = [text for text in raws if "RTL" in text]
    assert echoed and all("\u202e" not in text and "\\u202eRTL" in text for text in echoed), raws
