"""examples/edit_reward.py, the editing reward plugin named by path: keep (the source kept) and colour (the colour the
prompt names), against each prompt's source image in metadata["image"]."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ddpo_group.rewards import make_reward_fn

PLUGIN = str(Path(__file__).resolve().parents[2] / "examples" / "edit_reward.py") + ":edit_reward"


def test_the_edit_reward_scores_kept_source_and_asked_colour(tmp_path):
    source = np.zeros((8, 8, 3), dtype=np.uint8)
    source[:, :4] = (255, 0, 0)  # left half red, right half black
    Image.fromarray(source).save(tmp_path / "src.png")
    meta = {"image": str(tmp_path / "src.png")}
    copy = torch.from_numpy(source).permute(2, 0, 1).double() / 255
    blue = copy.clone()
    blue[:, :, :4] = torch.tensor([0.0, 0.0, 1.0])[:, None, None]  # the red half turned blue
    images = torch.stack([copy, blue, copy.flip(-1)]).float()
    fn = make_reward_fn(PLUGIN, keep_weight=1.0, colour_weight=2.0)
    rewards, info = fn(images, ["make the red half blue"] * 3, [meta] * 3)
    keep, colour = info["edit_keep"], info["edit_colour"]
    assert keep.dtype == torch.float64 and keep.tolist() == pytest.approx([1.0, 1 - 1 / 3, 1 - 1 / 3])
    # mean colours: (0.5, 0, 0), (0, 0, 0.5) and (0.5, 0, 0) against blue (0, 0, 1)
    far, near = 1 - np.sqrt(0.25 + 1) / np.sqrt(3), 1 - 0.5 / np.sqrt(3)
    assert colour.tolist() == pytest.approx([far, near, far])
    assert rewards.tolist() == pytest.approx((keep + 2 * colour).tolist())
    assert rewards[1] > rewards[0] > rewards[2]  # the asked edit beats the copy, which beats the mirrored source
    # a row's target_color wins over the prompt; a prompt naming no colour scores keep only
    _, info = fn(images[:1], ["edit it"], [{**meta, "target_color": [255, 0, 0]}])
    assert info["edit_colour"].tolist() == pytest.approx([1 - np.sqrt(0.25) / np.sqrt(3)])
    _, named = fn(images[:1], ["edit it"], [{**meta, "target_color": "Red"}])  # a colour name: the same target
    assert named["edit_colour"].tolist() == info["edit_colour"].tolist()
    with pytest.raises(ValueError, match=r"target_color='teal': a colour name of \['black', "):
        fn(images[:1], ["edit it"], [{**meta, "target_color": "teal"}])
    _, info = fn(images[:1], ["edit it"], [meta])
    assert info["edit_colour"].tolist() == [0.0]
    # a source of another size is resized to the edit's (PIL's default filter softens the red edge a little)
    Image.fromarray(source).resize((16, 16), Image.NEAREST).save(tmp_path / "big.png")
    _, info = fn(images[:1], ["x"], [{"image": str(tmp_path / "big.png")}])
    assert info["edit_keep"].tolist() == pytest.approx([1.0], abs=0.01)
    with pytest.raises(ValueError, match=r"needs one source image per prompt in metadata\['image'\]"):
        fn(images[:1], ["x"], [{}])
