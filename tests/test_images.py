"""Sample grids: each tile is the image rounded to uint8, framed by the padding, in row-major order."""

import numpy as np
import torch

from distill.utils.images import image_grid, to_pil, upscale


def test_grid_places_every_tile_row_major_with_padding_and_black_fill():
    x = torch.linspace(-1, 1, 5 * 3 * 4 * 6).reshape(5, 3, 4, 6)
    grid = np.asarray(image_grid(x, nrow=2, pad=1))
    assert grid.shape == (3 * (4 + 2), 2 * (6 + 2), 3)
    for i in range(5):
        r, c = divmod(i, 2)
        expected = ((x[i].permute(1, 2, 0) + 1) * 127.5).round().to(torch.uint8).numpy()
        np.testing.assert_array_equal(grid[r * 6 + 1: r * 6 + 5, c * 8 + 1: c * 8 + 7], expected)
    assert (grid[12:, 8:] == 0).all()  # the missing 6th tile
    frame = np.ones(grid.shape[:2], bool)
    for i in range(5):
        r, c = divmod(i, 2)
        frame[r * 6 + 1: r * 6 + 5, c * 8 + 1: c * 8 + 7] = False
    assert (grid[frame] == 0).all()


def test_grey_images_become_grey_tiles_and_upscale_is_nearest():
    x = torch.tensor([[[[-1.0, 1.0]]]])  # one 1x2 grey image
    (tile,) = to_pil(x)
    assert tile.mode == "L" and list(tile.getdata()) == [0, 255]
    big = np.asarray(upscale(image_grid(x, nrow=1, pad=0), 3))
    assert big.shape == (3, 6, 3) and (big[:, :3] == 0).all() and (big[:, 3:] == 255).all()
