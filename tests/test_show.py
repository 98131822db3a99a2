"""`tpplan show`: the picture measured (layers, kinds, collectives where they run, reasons,
parameters per rank as plan_stats counts them) on a tiny Llama, a mixture of experts and a
ViT; the SVG and HTML drawn from it; the command's output file and its errors."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import xml.dom.minidom
from pathlib import Path

import pytest
from support.models import TINY_LLAMA_FLAGS, tiny_llama
from support.plans import LLAMA_PLAN

from tpplan.cli import main
from tpplan.plan.rule import STYLE_CLASSES
from tpplan.show import (
    Collective,
    Group,
    Kind,
    Layer,
    Picture,
    Region,
    render_html,
    render_svg,
)
from tpplan.show.measure import picture_of
from tpplan.show.picture import KIND_OF_STYLE, OUTSIDE
from tpplan.show.svg import COLOURS, size_text

MOE = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}
VIT = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "image_size": 32,
    "patch_size": 8,
}


def _measured(spec: str, overrides: dict[str, int]) -> tuple[Picture, object, object]:
    from tpplan._runtime.models import build_model
    from tpplan.infer import infer_plan

    model = build_model(spec, overrides)
    plan = infer_plan(model, tp_size=2)
    return picture_of(model, plan, tp_size=2), model, plan


@pytest.fixture(scope="module")
def llama() -> tuple[Picture, object, object]:
    from tpplan.infer import infer_plan

    model = tiny_llama()
    plan = infer_plan(model, tp_size=2)
    return picture_of(model, plan, tp_size=2), model, plan


def _layers(picture: Picture, group: str) -> dict[str, Layer]:
    (found,) = [g for g in picture.groups if g.name == group]
    return {layer.name: layer for layer in found.layers}


def _after(layer: Layer) -> list[str]:
    return [str(c) for c in layer.collectives]


# ---- the picture, measured ------------------------------------------------------------------


def test_llama_block_is_drawn_once_for_both_layers(llama: tuple[Picture, object, object]) -> None:
    picture = llama[0]
    assert [g.name for g in picture.groups] == [OUTSIDE, "model.layers.*"]
    block = picture.groups[1]
    assert block.indices == (0, 1) and block.stack_size == 2


def test_llama_layers_in_forward_order_with_their_styles(
    llama: tuple[Picture, object, object],
) -> None:
    layers = _layers(llama[0], "model.layers.*")
    # in the forward's order, not the modules' (the norms come before the layers they feed)
    assert [(n, layer.kind) for n, layer in layers.items()] == [
        ("input_layernorm", Kind.NO_RULE),
        ("self_attn.q_proj", Kind.COLWISE),
        ("self_attn.k_proj", Kind.COLWISE),
        ("self_attn.v_proj", Kind.COLWISE),
        ("self_attn.o_proj", Kind.ROWWISE),
        ("post_attention_layernorm", Kind.NO_RULE),
        ("mlp.gate_proj", Kind.COLWISE),
        ("mlp.up_proj", Kind.COLWISE),
        ("mlp.down_proj", Kind.ROWWISE),
    ]
    outside = _layers(llama[0], OUTSIDE)
    assert outside["model.embed_tokens"].kind is Kind.VOCAB_PARALLEL
    assert outside["lm_head"].kind is Kind.GATHERED  # colwise, output replicate


def test_llama_collectives_where_they_run(llama: tuple[Picture, object, object]) -> None:
    layers = _layers(llama[0], "model.layers.*")
    assert {n: _after(layer) for n, layer in layers.items() if layer.collectives} == {
        "self_attn.o_proj": ["all-reduce"],
        "mlp.down_proj": ["all-reduce"],
    }
    outside = _layers(llama[0], OUTSIDE)
    assert _after(outside["model.embed_tokens"]) == ["all-reduce"]
    assert _after(outside["lm_head"]) == ["all-gather"]
    assert not any(g.own_collectives for g in llama[0].groups)


def test_llama_reasons_are_the_rules_whys(llama: tuple[Picture, object, object]) -> None:
    picture, _, plan = llama
    why = {r.match: r.why for r in plan.rules}  # type: ignore[attr-defined]
    for group in picture.groups:
        for layer in group.layers:
            if layer.rule is not None:
                assert layer.reason == why[layer.rule]
            else:
                assert layer.kind is Kind.NO_RULE and "no rule" in layer.reason


def test_parameters_per_rank_are_plan_stats_own(llama: tuple[Picture, object, object]) -> None:
    from tpplan.diagnose import plan_stats

    picture, model, plan = llama
    stats = plan_stats(model, plan, tp_size=2)  # type: ignore[arg-type]
    assert picture.bytes_per_rank == stats.param_bytes_per_rank
    assert picture.bytes_total == stats.param_bytes_total
    # every parameter is in one group: the outside modules once, a block once per layer
    groups = sum(g.bytes_per_rank * max(1, len(g.indices)) for g in picture.groups)
    assert groups == picture.bytes_per_rank
    layers = _layers(picture, "model.layers.*")
    assert layers["self_attn.q_proj"].bytes_per_rank * 2 == layers["self_attn.q_proj"].bytes_total
    assert layers["input_layernorm"].bytes_per_rank == layers["input_layernorm"].bytes_total


def test_a_mixture_of_experts_is_drawn() -> None:
    picture, _, _ = _measured("qwen2_moe", MOE)
    layers = _layers(picture, "model.layers.*")
    assert layers["mlp.experts"].kind is Kind.EXPERTS
    assert _after(layers["mlp.experts"]) == ["all-reduce"]
    assert _after(layers["mlp.shared_expert.down_proj"]) == ["all-reduce"]
    assert layers["mlp.shared_expert_gate"].kind is Kind.REPLICATE
    assert layers["mlp.experts"].bytes_per_rank * 2 == layers["mlp.experts"].bytes_total
    assert "experts" in render_svg(picture) and 'data-kind="experts"' in render_svg(picture)


def test_a_vision_model_is_drawn() -> None:
    picture, _, _ = _measured("vit", VIT)
    assert picture.model == "ViTModel"
    (block,) = [g for g in picture.groups if g.name != OUTSIDE]
    rowwise = [layer for layer in block.layers if layer.kind is Kind.ROWWISE]
    assert len(rowwise) == 2 and all(_after(layer) == ["all-reduce"] for layer in rowwise)
    gathered = [layer for g in picture.groups for layer in g.layers if layer.kind is Kind.GATHERED]
    assert gathered and all(_after(layer) == ["all-gather"] for layer in gathered)


# ---- the drawing ----------------------------------------------------------------------------


@pytest.mark.unit
def test_every_style_has_a_kind_and_every_kind_a_colour() -> None:
    assert set(KIND_OF_STYLE) == set(STYLE_CLASSES.values())
    assert set(COLOURS) == set(Kind)


def _hand_made() -> Picture:
    """A picture written by hand: a region, a reason to escape, a block's own gather."""
    layers = (
        Layer("attn.qkv", Kind.COLWISE, "layers.*.attn.qkv", 'split <heads> & "q"', (), 8, 16),
        Layer(
            "attn.out",
            Kind.ROWWISE,
            "layers.*.attn.out",
            "sums",
            (Collective("all-reduce", 1),),
            8,
            16,
        ),
        Layer("experts.*.w1", Kind.EXPERTS, "layers.*.experts.*.w1", "x", (), 32, 64, copies=4),
    )
    block = Group(
        "layers.*",
        (0, 1, 2),
        3,
        layers,
        (Region("attn", "its views see global shapes"),),
        (Collective("all-gather", 2),),
        48,
        96,
    )
    return Picture("Net", 2, (block,), 144, 288)


@pytest.mark.unit
def test_the_svg_is_well_formed_and_escapes_reasons() -> None:
    svg = render_svg(_hand_made())
    xml.dom.minidom.parseString(svg)  # raises on anything unescaped
    assert "split &lt;heads&gt; &amp; &quot;q&quot;" in svg
    assert "drawn once for all 3 blocks" in svg
    assert "experts.*.w1 x4" in svg and "2x all-gather" in svg
    assert "region attn" in svg and "its views see global shapes" in svg
    for kind in Kind:  # the legend names every kind
        assert f'data-kind="{kind.name.lower()}"' in svg and kind.value in svg
    assert "parameters per rank: 144 B of 288 B (50.0%)" in svg


@pytest.mark.unit
def test_the_html_needs_nothing_else() -> None:
    page = render_html(_hand_made())
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "<style>" in page
    for fetching in ("<script", "<link", "src=", "@import", "url(", "http://", "https://"):
        if fetching == "http://":  # the SVG namespace names a URL; it fetches nothing
            assert page.count("http://") == page.count('xmlns="http://www.w3.org/2000/svg"')
        else:
            assert fetching not in page


@pytest.mark.unit
def test_sizes_read_in_their_unit() -> None:
    assert [size_text(n) for n in (512, 3 * 1024, 5 * 2**20 // 2)] == [
        "512 B",
        "3.0 KiB",
        "2.5 MiB",
    ]


def test_the_llama_drawing_names_layers_collectives_reasons_and_sizes(
    llama: tuple[Picture, object, object],
) -> None:
    picture = llama[0]
    svg = render_svg(picture)
    xml.dom.minidom.parseString(svg)
    assert "LlamaForCausalLM at tp 2" in svg
    assert f"parameters per rank: {size_text(picture.bytes_per_rank)} of" in svg
    assert f"({picture.fraction:.1%})" in svg
    for name in ("self_attn.q_proj", "mlp.down_proj", "model.embed_tokens", "lm_head"):
        assert f'data-name="{name}"' in svg
    assert svg.count(">all-reduce</text>") == 3 + 1  # o_proj, down_proj, the embedding, legend
    assert svg.count(">all-gather</text>") == 1
    assert "token lookup" in svg  # the embedding's reason, beside it and in its <title>


# ---- the command ----------------------------------------------------------------------------


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.parametrize("name", ["plan.png", "plan", "plan.svg.txt"])
def test_an_unknown_suffix_is_one_line_with_the_fix(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / name
    code, err = _run(capsys, "show", "llama", "--tp", "2", "-o", str(out))
    suffix = f"'{out.suffix}'" if out.suffix else "no suffix"
    assert code == 2 and err.count("\n") == 1
    assert err == (
        f"tpplan: error: -o {out}: {suffix} is not a picture format tpplan show writes; end "
        f"the file name in .svg or .html, e.g. -o {out.with_suffix('.svg')}.\n"
    )
    assert not out.exists()


def test_show_writes_the_html_of_a_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "llama.html"
    code, err = _run(capsys, "show", "llama", "--tp", "2", *TINY_LLAMA_FLAGS, "-o", str(out))
    assert code == 0 and f"wrote {out} (LlamaForCausalLM at tp 2" in err
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and 'data-name="self_attn.o_proj"' in page


def test_show_draws_a_plan_file_on_a_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.svg"
    argv = ["show", str(LLAMA_PLAN), "llama", "--tp", "2", *TINY_LLAMA_FLAGS, "-o", str(out)]
    code, _ = _run(capsys, *argv)
    assert code == 0 and 'data-kind="rowwise"' in out.read_text()


@pytest.mark.unit
def test_a_plan_that_names_no_model_asks_for_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.svg"
    code, err = _run(capsys, "show", str(LLAMA_PLAN), "--tp", "2", "-o", str(out))
    assert code == 2 and err.count("\n") == 1
    assert "records no `tpplan infer` command" in err
    assert f"tpplan show {LLAMA_PLAN} MODEL --tp 2 -o {out}." in err


# ---- in a browser ---------------------------------------------------------------------------

_CHROMES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def _in_chrome(binary: str, page: Path, shot: Path) -> str:
    """The DOM a headless Chromium built from the page."""
    argv = [binary, "--headless", "--disable-gpu", "--no-sandbox", "--dump-dom", page.as_uri()]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout


def _in_firefox(binary: str, page: Path, shot: Path) -> str:
    """A headless Firefox's screenshot of the page (it prints no DOM): the page's own text
    when the screenshot was drawn."""
    argv = [binary, "--headless", "--screenshot", str(shot), page.as_uri()]
    subprocess.run(argv, capture_output=True, timeout=120, check=True)
    assert shot.stat().st_size > 10_000  # a drawn page, not a blank one
    return page.read_text()


def _in_playwright(binary: str, page: Path, shot: Path) -> str:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch()
        tab = browser.new_page()
        tab.goto(page.as_uri())
        assert tab.locator("g.layer").count() > 0  # the inline SVG was parsed into elements
        html = tab.content()
        browser.close()
    return html


@pytest.mark.slow
def test_the_html_renders_in_a_headless_browser(
    llama: tuple[Picture, object, object], tmp_path: Path
) -> None:
    found = [(b, _in_chrome) for b in _CHROMES if shutil.which(b)]
    found += [("firefox", _in_firefox)] if shutil.which("firefox") else []
    if importlib.util.find_spec("playwright") is not None:
        found.append(("playwright", _in_playwright))
    if not found:
        pytest.skip(
            "no headless browser here: none of chromium, chromium-browser, google-chrome, "
            "chrome or firefox is on PATH, and playwright is not installed"
        )
    binary, show = found[0]
    page = tmp_path / "llama.html"
    page.write_text(render_html(llama[0]))
    shown = show(shutil.which(binary) or binary, page, tmp_path / "shot.png")
    assert "<svg" in shown and 'data-name="self_attn.o_proj"' in shown
    assert "<title>" in shown and "token lookup" in shown
