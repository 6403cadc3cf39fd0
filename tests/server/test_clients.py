"""Real clients as acceptance: lm-eval-harness scores a multiple-choice task (defined from local files)
through ``sloserve serve`` (its ``local-completions`` backend: echo + logprobs over batches of token
ids) and through its own ``hf`` backend on the same model, and picks the same choice for every item
with the same log-likelihoods. Skipped, with the reason, where lm-eval is not installed (the test
extra installs it)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'sloserve[test]')")

from served_model import MODEL, Server  # noqa: E402

QUESTIONS = [
    ("The quick brown fox jumps over the", [" lazy dog.", " latency.", " world today?"], 0),
    ("Hello world, how are", [" you today?", " the fox", " models about"], 0),
    ("Serving language models is about", [" latency and throughput.", " the lazy dog.", " you"], 0),
    ("The quick brown", [" fox", " world", " serving"], 0),
    ("Hello", [" world", " dog", " latency"], 1),
    ("Serving language", [" models", " fox jumps", " today"], 2),
]
TASK = """task: sloserve_choices
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm-eval-task")
    data = root / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (root / "sloserve_choices.yaml").write_text(TASK.format(data=data))
    return root


def evaluate(task_dir, model: str, model_args: dict) -> dict[int, list[float]]:
    """Each item's log-likelihood of each choice, as lm-eval computes them with ``model``."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["sloserve_choices"],
        # (include_defaults=False: indexing lm-eval's thousands of own tasks took 10 s a call)
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        log_samples=True,
        batch_size=4,
    )
    return {s["doc_id"]: [r[0] for r in s["filtered_resps"]] for s in results["samples"]["sloserve_choices"]}


def test_lm_eval_scores_through_the_server_as_with_transformers(chat_model_dir, task_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    server = Server(chat_model_dir)
    try:
        served = evaluate(
            task_dir,
            "local-completions",
            {
                "model": MODEL,
                "base_url": f"{server.url}/v1/completions",
                "tokenizer": str(chat_model_dir),
                "tokenizer_backend": "huggingface",
                "num_concurrent": 1,
                "max_retries": 1,
                "add_bos_token": True,  # as the model's tokenizer does, and the hf backend by default
            },
        )
        echoed = sum(
            server.metric("sloserve_requests_total", request_class="rt", outcome=o) for o in ("stop", "length")
        )
    finally:
        server.stop()
    reference = evaluate(
        task_dir, "hf", {"pretrained": str(chat_model_dir), "dtype": "float32", "device": "cpu", "add_bos_token": True}
    )
    assert sorted(served) == sorted(reference) == list(range(len(QUESTIONS)))
    for doc_id, scores in reference.items():
        assert served[doc_id] == pytest.approx(scores, abs=1e-4), doc_id
        assert max(range(3), key=served[doc_id].__getitem__) == max(range(3), key=scores.__getitem__)
    assert echoed == sum(len(c) for _, c, _ in QUESTIONS)  # one echoed request per choice
