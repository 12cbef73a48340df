"""The bench's speculation headline figures, from a summary table."""

from __future__ import annotations

from builder.bench.report import headline_figures


def _entry(workload: str, row: str, x_plain: float, **info: object) -> dict:
    return {"workload": workload, "row": row, "speedup_vs_plain": x_plain, **info}


def _summary() -> dict:
    ours = dict(kind="ours", method="ngram")
    rows = []
    for w, plain_like in (("chat", (0.99, 1.01)), ("code", (1.05, 0.98)), ("copy", (1.9, 2.1)), ("all", (1.2, 1.3))):
        rows += [_entry(w, "plain", 1.0, kind="ours", method="off"),
                 _entry(w, "ngram k=4", plain_like[0], **ours), _entry(w, "ngram k=8", plain_like[1], **ours),
                 _entry(w, "ngram k=4 unpacked", 0.5, packed=False, **ours),  # a comparison row: not counted
                 _entry(w, "ngram k=4 via triton", 0.4, kind="triton", method="ngram"),
                 _entry(w, "hf prompt-lookup", 1.4 if w == "copy" else 0.9, kind="peer", method="ngram")]
    return {"environment": {}, "config": {}, "rows": rows}


def test_headline_figures_take_our_speculative_rows_only():
    figures = headline_figures(_summary())
    assert figures == {"worst_speculative_row_x_plain": 0.98, "best_all_x_plain": 1.3, "best_copy_x_plain": 2.1,
                       "copy_x_hf_prompt_lookup": 2.1 / 1.4}


def test_headline_figures_leave_out_what_was_not_measured():
    rows = [e for e in _summary()["rows"] if e["workload"] == "chat" and e["row"] != "hf prompt-lookup"]
    assert headline_figures({"rows": rows}) == {"worst_speculative_row_x_plain": 0.99}


def test_headline_figures_take_the_auto_row_and_eagle_tokens_per_pass():
    summary = _summary()
    summary["rows"] += [_entry("all", "auto", 1.7, kind="ours", method="auto"),
                        _entry("chat", "auto", 1.1, kind="ours", method="auto"),
                        _entry("all", "eagle k=3", 1.05, kind="ours", method="eagle", tokens_per_target_pass=1.4),
                        _entry("chat", "eagle k=3", 0.97, kind="ours", method="eagle", tokens_per_target_pass=1.2)]
    figures = headline_figures(summary)
    assert figures["auto_all_x_plain"] == 1.7 and figures["eagle_tokens_per_pass"] == 1.4
    assert figures["worst_speculative_row_x_plain"] == 0.97  # the auto and EAGLE rows count too


def test_auto_figure_is_the_best_exact_auto_row_whatever_its_model_drafter():
    """``auto_all_x_plain``: the best auto row over all workloads (EAGLE or the self draft beside
    lookup), not the comparison row without merged trees nor a row whose output differs from plain;
    an auto row with the self draft does not count as a self-draft row."""
    summary = _summary()
    auto = dict(kind="ours", method="auto", identical_to_plain=True)
    summary["rows"] += [_entry("all", "auto", 1.43, model_drafter="eagle", merge_lookup=True, **auto),
                        _entry("all", "auto unmerged", 1.9, model_drafter="eagle", merge_lookup=False, **auto),
                        _entry("all", "auto self-int8 k=6", 1.62, model_drafter="draft", self_draft="int8", **auto),
                        _entry("chat", "auto self-int8 k=6", 1.7, model_drafter="draft", self_draft="int8", **auto),
                        _entry("all", "auto self-int4 k=6", 2.5, model_drafter="draft",
                               **{**auto, "identical_to_plain": False})]
    figures = headline_figures(summary)
    assert figures["auto_all_x_plain"] == 1.62
    assert "selfdraft_chat_x_plain" not in figures


def test_selfdraft_chat_figure_is_the_best_exact_self_draft_row_on_chat():
    summary = _summary()
    self_info = dict(kind="ours", method="draft", draft="self")
    summary["rows"] += [_entry("chat", "self-int8 k=4", 1.45, precision="int8", identical_to_plain=True, **self_info),
                        _entry("chat", "self-int4 k=4", 1.6, precision="int4", identical_to_plain=False, **self_info),
                        _entry("copy", "self-int4 k=4", 1.9, precision="int4", identical_to_plain=True, **self_info),
                        _entry("chat", "draft k<=4 adaptive", 1.7, kind="ours", method="draft", identical_to_plain=True)]
    assert headline_figures(summary)["selfdraft_chat_x_plain"] == 1.45  # an output differing from plain never counts
    assert "selfdraft_chat_x_plain" not in headline_figures(_summary())


def test_a_cuda_run_writes_its_figures_under_gpu_keys():
    from builder.headline import device_keys

    assert device_keys({"best_all_x_plain": 1.3}, "cpu") == {"best_all_x_plain": 1.3}
    assert device_keys({"best_all_x_plain": 1.3, "auto_all_x_plain": 1.2}, "cuda:0") == {
        "gpu_best_all_x_plain": 1.3, "gpu_auto_all_x_plain": 1.2}


def test_heldout_split_figures_are_their_own_keys():
    from builder.bench.report import heldout_figures

    rows = [_entry(w, "plain", 1.0, kind="ours", method="off", identical_to_plain=True) for w in ("chat", "all")]
    rows += [_entry("chat", "auto", 1.3, kind="ours", method="auto", identical_to_plain=True),
             _entry("all", "auto", 1.6, kind="ours", method="auto", identical_to_plain=True),
             _entry("all", "auto unmerged", 1.9, kind="ours", method="auto", model_drafter="eagle",
                    merge_lookup=False, identical_to_plain=True),  # a comparison row: not the deployed auto
             _entry("chat", "eagle tree", 1.1, kind="ours", method="eagle", tokens_per_target_pass=1.8,
                    identical_to_plain=True),
             _entry("all", "eagle tree", 1.2, kind="ours", method="eagle", tokens_per_target_pass=2.0,
                    identical_to_plain=True),
             _entry("all", "hf prompt-lookup", 3.0, kind="peer", method="ngram")]
    figures = heldout_figures({"rows": rows})
    assert figures == {"eagle_heldout_chat_tokens_per_pass": 1.8, "heldout_chat_auto_x_plain": 1.3,
                       "eagle_heldout_all_tokens_per_pass": 2.0, "heldout_all_auto_x_plain": 1.6,
                       "heldout_rows_identical_to_plain": 1.0}
    rows[3]["identical_to_plain"] = False
    assert heldout_figures({"rows": rows})["heldout_rows_identical_to_plain"] == 0.0
    assert not set(figures) & set(headline_figures({"rows": rows}))
    mtbench = heldout_figures({"rows": rows}, "mtbench")
    assert set(mtbench) == {"eagle_mtbench_chat_tokens_per_pass", "mtbench_chat_auto_x_plain",
                            "eagle_mtbench_all_tokens_per_pass", "mtbench_all_auto_x_plain",
                            "mtbench_rows_identical_to_plain"}
