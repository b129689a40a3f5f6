"""The compiled training module against PyTorch: loss, gradients, SGD/Adam steps, lr per call,
falling loss, determinism and clear errors."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from compiler import InputError, load_artifact

torch.set_num_threads(1)


def _mlp_torch(params, x):
    w0, b0, w1, b1 = params
    return torch.relu(x @ w0 + b0) @ w1 + b1


def _make_cnn_torch(mean: np.ndarray, var: np.ndarray):
    mean_t, var_t = torch.from_numpy(mean), torch.from_numpy(var)

    def fwd(c1_w, c1_b, bn_s, bn_b, dw_w, dw_b, pw_w, pw_b, fc_w, fc_b, x):
        y = F.conv2d(x, c1_w, c1_b, padding=1)
        y = F.batch_norm(y, mean_t, var_t, bn_s, bn_b, training=False, eps=1e-5)
        y = torch.relu(y)
        y = torch.relu(F.conv2d(y, dw_w, dw_b, padding=1, groups=8))
        y = F.max_pool2d(y, 2, 2)
        y = torch.relu(F.conv2d(y, pw_w, pw_b))
        y = y.mean(dim=(2, 3))
        return y @ fc_w.T + fc_b

    return fwd


def _torch_loss_grad(forward, params, x, y, loss):
    tp = [torch.tensor(p, dtype=torch.float64, requires_grad=True) for p in params]
    out = forward(tp, torch.tensor(x, dtype=torch.float64))
    if loss == "ce":
        val = F.cross_entropy(out, torch.tensor(y))
    else:
        val = F.mse_loss(out, torch.tensor(y, dtype=torch.float64))
    val.backward()
    return float(val.detach()), [t.grad.numpy() for t in tp]


def _assert_grads_close(got, want, names):
    for name, g, w in zip(names, got, want, strict=True):
        scale = max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(g, w, atol=2e-5 * scale, rtol=1e-4, err_msg=f"gradient of {name}")


def test_digits_mlp_loss_and_grad_match_pytorch(compiler_digits_artifact):
    art = load_artifact(compiler_digits_artifact)
    tr = art.trainer
    assert (tr.batch, tr.loss, tr.optimizer, tr.lr) == (32, "ce", "sgd", 0.1)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((32, 64)).astype(np.float32)
    y = rng.integers(0, 10, 32).astype(np.int64)
    loss, grads = tr.loss_and_grad(art.params, x, y)
    ref_loss, ref_grads = _torch_loss_grad(_mlp_torch, art.params, x, y, "ce")
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert [g.shape for g in grads] == [p.shape for p in art.params]
    _assert_grads_close(grads, ref_grads, art.param_names)


def test_small_cnn_loss_and_grad_match_pytorch(cnn_artifact, cnn_onnx):
    import onnx
    from onnx import numpy_helper

    inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(cnn_onnx)).graph.initializer}
    art = load_artifact(cnn_artifact)
    # BN running statistics are compile-time constants, not trainable parameters
    assert art.param_names == [
        "c1_w",
        "c1_b",
        "bn_scale",
        "bn_bias",
        "dw_w",
        "dw_b",
        "pw_w",
        "pw_b",
        "fc_w",
        "fc_b",
    ]
    fwd = _make_cnn_torch(inits["bn_mean"].astype(np.float64), inits["bn_var"].astype(np.float64))
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    y = np.array([0, 3, 1, 2], dtype=np.int64)
    loss, grads = art.trainer.loss_and_grad(art.params, x, y)
    ref_loss, ref_grads = _torch_loss_grad(lambda p, t: fwd(*p, t), art.params, x, y, "ce")
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    _assert_grads_close(grads, ref_grads, art.param_names)


def test_mse_adam_match_pytorch_over_three_steps(mse_adam_artifact):
    art = load_artifact(mse_adam_artifact)
    tr = art.trainer
    assert (tr.loss, tr.optimizer, tr.batch) == ("mse", "adam", 6)
    rng = np.random.default_rng(5)
    params = art.params
    state = tr.init_state(params)
    tp = [torch.tensor(p, requires_grad=True) for p in params]
    opt = torch.optim.Adam(tp, lr=0.01)
    for step in range(3):
        x = rng.standard_normal((6, 8)).astype(np.float32)
        y = rng.standard_normal((6, 4)).astype(np.float32)
        loss, grads = tr.loss_and_grad(params, x, y)
        ref_loss, ref_grads = _torch_loss_grad(_mlp_torch, params, x, y, "mse")
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"step {step}"
        _assert_grads_close(grads, ref_grads, art.param_names)
        params, state = tr.apply(params, grads, state, lr=0.01)
        opt.zero_grad()
        for t, g in zip(tp, grads, strict=True):
            t.grad = torch.from_numpy(g.copy())
        opt.step()
        for name, p, t in zip(art.param_names, params, tp, strict=True):
            np.testing.assert_allclose(p, t.detach().numpy(), atol=1e-6, err_msg=f"{name} after step {step}")
    assert int(state[0]) == 3


def test_sgd_step_is_p_minus_lr_g_and_lr_is_per_call(compiler_digits_artifact):
    tr = load_artifact(compiler_digits_artifact).trainer
    params = load_artifact(compiler_digits_artifact).params
    rng = np.random.default_rng(6)
    grads = [rng.standard_normal(p.shape).astype(np.float32) for p in params]
    state = tr.init_state(params)
    for lr in (None, 0.5, 0.003):
        new, new_state = tr.apply(params, grads, state, lr=lr)
        rate = np.float32(0.1 if lr is None else lr)
        for p, g, q in zip(params, grads, new, strict=True):
            np.testing.assert_allclose(q, p - rate * g, atol=1e-6)
        assert int(new_state[0]) == 1
    # inputs are not modified in place
    fresh = load_artifact(compiler_digits_artifact).params
    assert all(np.array_equal(a, b) for a, b in zip(params, fresh, strict=True))
    with pytest.raises(InputError, match="learning rate"):
        tr.apply(params, grads, state, lr=-1.0)


def test_loss_falls_on_sklearn_digits(compiler_digits_artifact):
    from sklearn.datasets import load_digits

    data = load_digits()
    x_all = (data.data / 16.0).astype(np.float32)
    y_all = data.target.astype(np.int64)
    art = load_artifact(compiler_digits_artifact)
    tr = art.trainer
    params, state = art.params, tr.init_state(art.params)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(80):
        idx = rng.choice(len(x_all), 32, replace=False)
        loss, grads = tr.loss_and_grad(params, x_all[idx], y_all[idx])
        params, state = tr.apply(params, grads, state)
        losses.append(loss)
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5]), losses
    # the trained parameters also serve inference (params as runtime inputs)
    acc_before = (art.infer({"x": x_all[:300]})["logits"].argmax(1) == y_all[:300]).mean()
    acc_after = (art.infer({"x": x_all[:300]}, params)["logits"].argmax(1) == y_all[:300]).mean()
    assert acc_after > max(0.5, acc_before + 0.2), (acc_before, acc_after)


def test_two_trainers_are_bit_identical(cnn_artifact):
    a, b = load_artifact(cnn_artifact), load_artifact(cnn_artifact)
    rng = np.random.default_rng(7)
    pa, pb = a.params, b.params
    sa, sb = a.trainer.init_state(pa), b.trainer.init_state(pb)
    for _ in range(4):
        x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
        y = rng.integers(0, 4, 4).astype(np.int64)
        la, ga = a.trainer.loss_and_grad(pa, x, y)
        lb, gb = b.trainer.loss_and_grad(pb, x, y)
        assert la == lb
        assert all(np.array_equal(u, v) for u, v in zip(ga, gb, strict=True))
        pa, sa = a.trainer.apply(pa, ga, sa, lr=0.05)
        pb, sb = b.trainer.apply(pb, gb, sb, lr=0.05)
    assert all(u.tobytes() == v.tobytes() for u, v in zip(pa, pb, strict=True))
    assert not all(np.array_equal(u, v) for u, v in zip(pa, a.params, strict=True))


def test_cnn_loss_falls(cnn_artifact):
    art = load_artifact(cnn_artifact)
    tr = art.trainer
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4, 3, 8, 8)).astype(np.float32)
    y = np.array([0, 1, 2, 3], dtype=np.int64)
    params, state = art.params, tr.init_state(art.params)
    first, _ = tr.loss_and_grad(params, x, y)
    for _ in range(40):
        loss, grads = tr.loss_and_grad(params, x, y)
        params, state = tr.apply(params, grads, state, lr=0.5)
    assert loss < 0.25 * first, (first, loss)  # overfits 4 samples


def test_training_input_errors(compiler_digits_artifact):
    art = load_artifact(compiler_digits_artifact)
    tr = art.trainer
    x = np.zeros((32, 64), np.float32)
    with pytest.raises(InputError, match=r"expected float32\[32, 64\]"):
        tr.loss_and_grad(art.params, np.zeros((31, 64), np.float32), np.zeros(31, np.int64))
    with pytest.raises(InputError, match="targets have shape"):
        tr.loss_and_grad(art.params, x, np.zeros(30, np.int64))
    with pytest.raises(InputError, match="targets have dtype"):
        tr.loss_and_grad(art.params, x, np.zeros(32, np.float32))
    with pytest.raises(InputError, match="expected 4 parameters"):
        tr.loss_and_grad(art.params[:3], x, np.zeros(32, np.int64))
    with pytest.raises(InputError, match="optimizer state"):
        tr.apply(art.params, art.params, [], lr=0.1)


def test_inference_not_blocked_by_a_training_step(compiler_digits_artifact):
    """A training step holds the trainer's lock; inference on other threads must not wait for it."""
    art = load_artifact(compiler_digits_artifact)
    x = np.ones((3, 64), np.float32)
    done = threading.Event()
    with art.trainer._lock:  # a training step "in progress"
        t = threading.Thread(target=lambda: (art.infer({"x": x}), done.set()))
        t0 = time.perf_counter()
        t.start()
        assert done.wait(30), "inference waited for the training step"
        assert time.perf_counter() - t0 < 30
    t.join()
