"""Reward and prompt plugins: registry names, module:function paths, entry points; weighted combinations."""

import random
import textwrap
from importlib import metadata

import pytest
import torch

from ddpo_group import registry
from ddpo_group.prompts import PromptSampler, get_prompt_fn
from ddpo_group.rewards import make_reward_fn
from ddpo_group.rewards.combine import make_reward_components, parse_reward_spec, split_kwargs

PLUGIN_SOURCE = textwrap.dedent(
    """
    import torch

    LOADS = []

    def make_mean_reward(scale=1.0):
        LOADS.append(scale)  # the factory runs once; the returned fn many times
        def fn(images, prompts, metadata):
            return images.mean(dim=(1, 2, 3)).double() * scale, {"length": torch.tensor([float(len(p)) for p in prompts])}
        return fn

    def count_prompt(rng=None, prefix="item"):
        return f"{prefix} {rng.randint(0, 9)}", {"source": "plugin"}
    """
)


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    (tmp_path / "my_plugin_mod.py").write_text(PLUGIN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "my_plugin_mod.py"


def test_reward_plugin_loaded_by_module_path(plugin_module):
    images = torch.stack([torch.full((3, 4, 4), 0.25), torch.full((3, 4, 4), 0.5)])
    fn = make_reward_fn("my_plugin_mod:make_mean_reward", scale=2.0)
    rewards, info = fn(images, ["ab", "abcd"], [{}, {}])
    assert rewards.tolist() == [0.5, 1.0]
    # kwargs may also be nested under the reward's name, as for a combination
    nested = make_reward_fn("my_plugin_mod:make_mean_reward", **{"my_plugin_mod:make_mean_reward": {"scale": 4.0}})
    assert nested(images, ["ab", "abcd"], [{}, {}])[0].tolist() == [1.0, 2.0]
    assert info["length"].tolist() == [2.0, 4.0]
    import my_plugin_mod

    fn(images, ["a", "b"], [{}, {}])
    assert my_plugin_mod.LOADS == [2.0, 4.0]  # each factory ran once


def test_reward_plugin_loaded_by_file_path(plugin_module):
    fn = make_reward_fn(f"{plugin_module}:make_mean_reward")
    rewards, _ = fn(torch.full((1, 3, 2, 2), 0.75), ["x"], [{}])
    assert rewards.tolist() == [0.75]


def test_bad_plugin_paths_name_what_is_missing(plugin_module, tmp_path):
    with pytest.raises(AttributeError, match=r"'my_plugin_mod' has no attribute 'nope'"):
        make_reward_fn("my_plugin_mod:nope")
    with pytest.raises(ModuleNotFoundError, match=r"cannot import module 'not_a_module_xyz'"):
        make_reward_fn("not_a_module_xyz:f")
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        make_reward_fn(f"{tmp_path}/missing.py:f")


def test_prompt_plugin_loaded_by_module_path(plugin_module):
    sampler = PromptSampler("my_plugin_mod:count_prompt", {"prefix": "thing"}, seed=1)
    prompts, meta = sampler.sample(4)
    rng = random.Random(1)
    assert prompts == [f"thing {rng.randint(0, 9)}" for _ in range(4)]
    assert meta == [{"source": "plugin"}] * 4


class FakeEntryPoint:
    def __init__(self, name, group, obj):
        self.name, self.group, self._obj = name, group, obj

    def load(self):
        return self._obj


def fake_entry_points(monkeypatch, points):
    real = metadata.entry_points

    def entry_points(**params):
        group = params.get("group")
        if group in ("ddpo_group.rewards", "ddpo_group.prompts"):
            return [p for p in points if p.group == group]
        return real(**params)

    monkeypatch.setattr(registry.metadata, "entry_points", entry_points)


def test_entry_point_plugins_for_rewards_and_prompts(monkeypatch):
    def make_const(value=3.0):
        return lambda images, prompts, metadata: (torch.full((len(prompts),), value), {})

    def hello(rng=None):
        return "hello", {}

    fake_entry_points(monkeypatch, [
        FakeEntryPoint("const_reward", "ddpo_group.rewards", make_const),
        FakeEntryPoint("hello_prompts", "ddpo_group.prompts", hello),
    ])
    rewards, _ = make_reward_fn("const_reward", value=1.5)(torch.zeros(2, 3, 4, 4), ["a", "b"], [{}, {}])
    assert rewards.tolist() == [1.5, 1.5]
    assert get_prompt_fn("hello_prompts") is hello
    # an unknown name lists registered names and installed plugins
    with pytest.raises(ValueError, match=r"unknown reward_fn 'nope'.*installed plugins .*\['const_reward'\]"):
        make_reward_fn("nope")
    with pytest.raises(ValueError, match=r"unknown prompt_fn 'nope'.*\['hello_prompts'\]"):
        get_prompt_fn("nope")


def test_registered_names_win_over_entry_points(monkeypatch):
    fake_entry_points(monkeypatch, [FakeEntryPoint("simple_animals", "ddpo_group.prompts", lambda rng=None: ("x", {}))])
    assert get_prompt_fn("simple_animals")(rng=random.Random(0))[0] != "x"


def test_from_file_prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("a cat\n\n  a dog  \na horse\n")
    prompts, _ = PromptSampler("from_file", {"path": str(path)}, seed=0).sample(30)
    assert set(prompts) == {"a cat", "a dog", "a horse"}
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        PromptSampler("from_file", {"path": str(tmp_path / "missing.txt")}).sample(1)
    with pytest.raises(ValueError, match="prompt_fn_kwargs.path"):
        PromptSampler("from_file").sample(1)


# ------------------------------------------------------------------ weighted combination
def test_reward_spec_forms():
    assert parse_reward_spec("jpeg_compressibility") == {"jpeg_compressibility": 1.0}
    expected = {"jpeg_compressibility": 1.0, "jpeg_incompressibility": 2.0}
    assert parse_reward_spec('{"jpeg_compressibility": 1.0, "jpeg_incompressibility": 2}') == expected
    assert parse_reward_spec("{'jpeg_compressibility': 1, 'jpeg_incompressibility': 2.0}") == expected
    import ml_collections

    assert parse_reward_spec(ml_collections.ConfigDict(expected)) == expected
    with pytest.raises(ValueError, match=r"weight of 'a' is 'high'"):
        parse_reward_spec({"a": "high"})
    with pytest.raises(ValueError, match=r"not a valid \{name: weight\} literal"):
        parse_reward_spec("{a: 1}")
    with pytest.raises(ValueError, match="non-empty mapping"):
        parse_reward_spec({})


def test_weighted_combination_hand_computed(plugin_module):
    images = torch.stack([torch.full((3, 4, 4), 0.25), torch.full((3, 4, 4), 0.5)])
    jpeg, _ = make_reward_fn("jpeg_compressibility")(images, ["a", "b"], [{}, {}])
    spec = {"jpeg_compressibility": 1.0, "my_plugin_mod:make_mean_reward": 2.0}
    fn = make_reward_fn(spec, **{"my_plugin_mod:make_mean_reward": {"scale": 3.0}})
    rewards, info = fn(images, ["ab", "abc"], [{}, {}])
    # mean reward: 3 * pixel mean = [0.75, 1.5]; total = jpeg + 2 * that
    expected = jpeg + 2.0 * torch.tensor([0.75, 1.5], dtype=torch.float64)
    torch.testing.assert_close(rewards, expected)
    assert rewards.dtype == torch.float64
    torch.testing.assert_close(info["jpeg_compressibility"], jpeg)
    torch.testing.assert_close(info["make_mean_reward"], torch.tensor([0.75, 1.5], dtype=torch.float64))
    torch.testing.assert_close(info["jpeg_compressibility/jpeg_kb"], -jpeg)
    assert info["make_mean_reward/length"].tolist() == [2.0, 3.0]
    assert fn.components == [("jpeg_compressibility", 1.0), ("make_mean_reward", 2.0)]
    # the same through the command-line form (a JSON string)
    fn2 = make_reward_fn('{"jpeg_compressibility": 1.0, "my_plugin_mod:make_mean_reward": 2.0}',
                         **{"my_plugin_mod:make_mean_reward": {"scale": 3.0}})
    torch.testing.assert_close(fn2(images, ["ab", "abc"], [{}, {}])[0], expected)


def test_combination_kwargs_are_per_component():
    assert split_kwargs({"a": 1.0}, {"q": 1}) == {"a": {"q": 1}}
    assert split_kwargs({"a": 1.0}, {"a": {"q": 1}}) == {"a": {"q": 1}}
    assert split_kwargs({"a": 1.0, "b": 2.0}, {"b": {"q": 1}}) == {"a": {}, "b": {"q": 1}}
    with pytest.raises(ValueError, match=r"keys \['q'\] are not components of reward_fn \['a', 'b'\]"):
        split_kwargs({"a": 1.0, "b": 2.0}, {"q": 1})
    labels = [label for label, _, _ in make_reward_components({"jpeg_compressibility": 0.5, "jpeg_incompressibility": 1})]
    assert labels == ["jpeg_compressibility", "jpeg_incompressibility"]


def test_component_error_names_the_component(plugin_module, tmp_path):
    (tmp_path / "bad_reward_mod.py").write_text(
        "import torch\ndef make():\n    return lambda i, p, m: (torch.tensor([float('nan')] * len(p)), {})\n"
    )
    fn = make_reward_fn({"jpeg_compressibility": 1.0, "bad_reward_mod:make": 1.0})
    with pytest.raises(ValueError, match=r"reward function 'make' returned non-finite rewards"):
        fn(torch.zeros(2, 3, 4, 4), ["a", "b"], [{}, {}])


def test_entry_point_of_an_installed_distribution(tmp_path, monkeypatch):
    """A real (if minimal) installed distribution: a .dist-info with entry_points.txt on sys.path."""
    (tmp_path / "tiny_reward_pkg.py").write_text(
        "import torch\n"
        "def make(offset=0.0):\n"
        "    return lambda images, prompts, metadata: (torch.arange(len(prompts), dtype=torch.float64) + offset, {})\n"
        "def prompt(rng=None):\n"
        "    return 'from a package', {}\n"
    )
    info = tmp_path / "tiny_reward_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny-reward-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[ddpo_group.rewards]\ntiny_index_reward = tiny_reward_pkg:make\n\n"
        "[ddpo_group.prompts]\ntiny_pkg_prompt = tiny_reward_pkg:prompt\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "tiny_index_reward" in registry.entry_point_names("ddpo_group.rewards")
    rewards, _ = make_reward_fn("tiny_index_reward", offset=0.5)(torch.zeros(3, 3, 2, 2), ["a"] * 3, [{}] * 3)
    assert rewards.tolist() == [0.5, 1.5, 2.5]
    assert PromptSampler("tiny_pkg_prompt").sample(2)[0] == ["from a package"] * 2


def test_a_reward_function_given_where_its_factory_belongs_is_named_with_the_factory_shape(tmp_path):
    from ddpo_group.rewards import make_reward_fn

    plugin = tmp_path / "plain.py"
    plugin.write_text("def my_reward(images, prompts, metadata):\n    return [0.0] * len(images), {}\n")
    with pytest.raises(ValueError) as raised:
        make_reward_fn(f"{plugin}:my_reward")
    message = str(raised.value)
    assert f"reward_fn '{plugin}:my_reward' is a reward function fn(images, prompts, metadata)" in message
    assert "names its factory" in message and "def make_my_reward(**kwargs):" in message
    # its factory is accepted
    factory = tmp_path / "factory.py"
    factory.write_text("def make(**kwargs):\n    return lambda images, prompts, metadata: ([0.5] * len(images), {})\n")
    assert callable(make_reward_fn(f"{factory}:make"))
