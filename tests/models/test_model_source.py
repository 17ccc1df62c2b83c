"""A model source that cannot load fails at once, in one line that names the key the user set
(model.path, never a key they did not set), and says why a hub id cannot come from the hub."""

from __future__ import annotations

import http.server
import socket
import threading

import pytest

from relign.config import ConfigError
from relign.models import loading
from relign.models.loading import check_model_source, hub_unreachable, load_causal_lm, load_tokenizer


@pytest.fixture
def online(monkeypatch):
    """No offline variable set; the probe cache cleared before and after."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    loading._probe.cache_clear()
    yield monkeypatch
    loading._probe.cache_clear()


def _closed_port() -> int:
    """A local port nobody listens on: connecting is refused at once (no network involved)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_missing_local_folder_names_model_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ConfigError) as e:
        load_tokenizer(str(missing))  # the recipes load the tokenizer first, from model.path
    assert str(e.value) == f"model.path={missing}: no such folder"
    with pytest.raises(ConfigError, match=r"^model\.path=runs/a/b: no such folder$"):
        check_model_source("runs/a/b")  # two slashes: a path, not a hub id
    with pytest.raises(ConfigError, match=r"^MODEL=\./x: no such folder$"):
        check_model_source("./x", "MODEL")


def test_file_or_folder_without_model(tmp_path):
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(ConfigError, match=r"weights\.bin: is a file; give the model's folder$"):
        load_causal_lm(str(tmp_path / "weights.bin"))
    with pytest.raises(ConfigError, match=r"^model\.path=.*: not a model folder \(no config\.json or adapter_config\.json\)$"):
        load_causal_lm(str(tmp_path))


def test_tokenizer_folder_on_its_own_is_accepted(tiny_model_dir, tmp_path):
    import shutil

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / f, tok_dir / f)
    tok = load_tokenizer(str(tok_dir), key="model.tokenizer")
    assert tok("2 + 3")["input_ids"]


def test_hub_id_offline_says_so(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as e:
        load_tokenizer("some-org/some-model")
    msg = str(e.value)
    assert msg.startswith("model.path=some-org/some-model: no such local folder, and it cannot come from the hub: ")
    assert "HF_HUB_OFFLINE is set (offline mode)" in msg and "\n" not in msg


def test_unreachable_hub_is_found_by_one_probe(online):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    online.setattr("huggingface_hub.constants.ENDPOINT", endpoint)
    online.setenv("RELIGN_HUB_TIMEOUT", "2")
    why = hub_unreachable()
    assert why is not None and why.startswith(f"cannot reach the hub at {endpoint} (") and why.endswith("; one try, 2 s timeout)")
    with pytest.raises(ConfigError, match=r"^model\.path=org/name: no such local folder, and it cannot come from the hub: cannot reach"):
        check_model_source("org/name")


def test_reachable_hub_lets_hub_ids_through(online):
    class Answer(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):  # any status counts: the hub is there
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        online.setattr("huggingface_hub.constants.ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        assert hub_unreachable() is None
        assert check_model_source("org/name") is False  # load it from the hub, as transformers does
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
