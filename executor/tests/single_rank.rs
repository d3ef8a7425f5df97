//! The single-rank run (tp1 pp1 dp1) against an independent naive model written here in
//! f64 with plain loops: the step's loss, and the gradients by central finite differences
//! of the naive loss (every tensor along random directions, plus sampled elements).

mod common;

use shardwright_executor::model::{lr_at, tokens, Dims};
use shardwright_executor::rng::Rng;
use std::collections::BTreeMap;

type P = BTreeMap<String, Vec<f64>>;

fn rms(x: &[f64], w: &[f64]) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + 1e-5).sqrt();
    x.iter().zip(w).map(|(a, b)| a * r * b).collect()
}

/// The norm `name` of `x`: RMSNorm, or LayerNorm with `{name}_bias`.
fn norm(dm: &Dims, p: &P, x: &[f64], name: &str) -> Vec<f64> {
    let w = &p[name];
    if !dm.layernorm {
        return rms(x, w);
    }
    let b = &p[&format!("{name}_bias")];
    let n = x.len() as f64;
    let m = x.iter().sum::<f64>() / n;
    let var = x.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / n;
    let r = 1.0 / (var + 1e-5).sqrt();
    x.iter()
        .zip(w)
        .zip(b)
        .map(|((v, w), b)| (v - m) * r * w + b)
        .collect()
}

/// `x [n] @ w [n, m]`.
fn vm(x: &[f64], w: &[f64], m: usize) -> Vec<f64> {
    let mut y = vec![0.0; m];
    for (i, xi) in x.iter().enumerate() {
        for j in 0..m {
            y[j] += xi * w[i * m + j];
        }
    }
    y
}

fn rope(x: &mut [f64], pos: usize, d: usize) {
    let half = d / 2;
    for i in 0..half {
        let a = pos as f64 * 10000f64.powf(-(2.0 * i as f64) / d as f64);
        let (c, s) = (a.cos(), a.sin());
        let (p, q) = (x[i], x[i + half]);
        x[i] = p * c - q * s;
        x[i + half] = q * c + p * s;
    }
}

/// An MLP: SwiGLU (`x @ fc1` as gate, up halves of width `f`, `silu(gate) up`, `@ fc2`)
/// or GeLU in its tanh form (`gelu(x @ fc1) @ fc2`).
fn mlp(dm: &Dims, x: &[f64], fc1: &[f64], fc2: &[f64], f: usize, h: usize) -> Vec<f64> {
    let act: Vec<f64> = if dm.gelu {
        let a = vm(x, fc1, f);
        let c = (2.0 / std::f64::consts::PI).sqrt();
        a.iter()
            .map(|v| 0.5 * v * (1.0 + (c * (v + 0.044715 * v * v * v)).tanh()))
            .collect()
    } else {
        let a = vm(x, fc1, 2 * f);
        (0..f)
            .map(|j| a[j] / (1.0 + (-a[j]).exp()) * a[f + j])
            .collect()
    };
    vm(&act, fc2, h)
}

/// Objective of the naive model: the mean cross-entropy plus the MoE load-balancing loss.
fn naive_loss(dm: &Dims, p: &P, seqs: &[Vec<u32>]) -> f64 {
    let (ce, aux) = naive_losses(dm, p, seqs, common::cfg().moe_aux_coef as f64);
    ce + aux
}

/// The naive model's mean cross-entropy over `seqs` (each `seq + 1` tokens) and its MoE
/// load-balancing loss: per MoE layer and sequence `coef E sum_e f_e P_e` (`f_e`: share
/// of the sequence's `s k` routed slots on expert `e`; `P_e`: mean probability of `e`),
/// averaged over the sequences and summed over the layers. Routing: softmax over every
/// expert, the `k` most probable (ties: lower index), gates renormalized over them.
fn naive_losses(dm: &Dims, p: &P, seqs: &[Vec<u32>], coef: f64) -> (f64, f64) {
    let (h, nh, nk, d, f, v, s) = (dm.h, dm.heads, dm.kv_heads, dm.d, dm.f, dm.vocab, dm.seq);
    let mut total = 0.0;
    let mut aux = 0.0;
    for toks in seqs {
        let mut x: Vec<Vec<f64>> = (0..s)
            .map(|i| {
                let mut e = p["embedding"][toks[i] as usize * h..][..h].to_vec();
                if dm.learned_positions {
                    for (a, b) in e.iter_mut().zip(&p["pos_embedding"][i * h..(i + 1) * h]) {
                        *a += b;
                    }
                }
                e
            })
            .collect();
        for l in 0..dm.layers {
            let w = |n: &str| &p[&format!("L{l}.{n}")];
            let mut q = Vec::new();
            let mut k = Vec::new();
            let mut vv = Vec::new();
            for (i, xi) in x.iter().enumerate() {
                let y = vm(
                    &norm(dm, p, xi, &format!("L{l}.attn_norm")),
                    w("qkv"),
                    (nh + 2 * nk) * d,
                );
                let rot = !dm.learned_positions;
                let mut qi = y[..nh * d].to_vec();
                let mut ki = y[nh * d..(nh + nk) * d].to_vec();
                for hh in 0..nh {
                    if rot {
                        rope(&mut qi[hh * d..(hh + 1) * d], i, d);
                    }
                }
                for hh in 0..nk {
                    if rot {
                        rope(&mut ki[hh * d..(hh + 1) * d], i, d);
                    }
                }
                q.push(qi);
                k.push(ki);
                vv.push(y[(nh + nk) * d..].to_vec());
            }
            for i in 0..s {
                let mut o = vec![0.0; nh * d];
                for hh in 0..nh {
                    let kh = hh / (nh / nk);
                    let sc: Vec<f64> = (0..=i)
                        .map(|j| {
                            (0..d)
                                .map(|c| q[i][hh * d + c] * k[j][kh * d + c])
                                .sum::<f64>()
                                / (d as f64).sqrt()
                        })
                        .collect();
                    let mx = sc.iter().copied().fold(f64::MIN, f64::max);
                    let z: f64 = sc.iter().map(|a| (a - mx).exp()).sum();
                    for (j, a) in sc.iter().enumerate() {
                        for c in 0..d {
                            o[hh * d + c] += (a - mx).exp() / z * vv[j][kh * d + c];
                        }
                    }
                }
                let y = vm(&o, w("proj"), h);
                for c in 0..h {
                    x[i][c] += y[c];
                }
            }
            if !dm.is_moe_layer(l) {
                for xi in x.iter_mut() {
                    let n = norm(dm, p, xi, &format!("L{l}.mlp_norm"));
                    let y = mlp(dm, &n, w("fc1"), w("fc2"), f, h);
                    for c in 0..h {
                        xi[c] += y[c];
                    }
                }
                continue;
            }
            let m = dm.moe.as_ref().unwrap();
            let (ne, k) = (m.experts, m.top_k);
            let mut count = vec![0.0; ne];
            let mut psum = vec![0.0; ne];
            for xi in x.iter_mut() {
                let n = norm(dm, p, xi, &format!("L{l}.mlp_norm"));
                let lg = vm(&n, w("router"), ne);
                let mx = lg.iter().copied().fold(f64::MIN, f64::max);
                let z: f64 = lg.iter().map(|a| (a - mx).exp()).sum();
                let pr: Vec<f64> = lg.iter().map(|a| (a - mx).exp() / z).collect();
                let mut idx: Vec<usize> = (0..ne).collect();
                idx.sort_by(|&a, &b| pr[b].partial_cmp(&pr[a]).unwrap());
                let sel = &idx[..k];
                let ssum: f64 = sel.iter().map(|&e| pr[e]).sum();
                let mut y = vec![0.0; h];
                for &e in sel {
                    let fc = |n_: &str| &p[&format!("L{l}.e{e}.{n_}")];
                    let o = mlp(dm, &n, fc("expert_fc1"), fc("expert_fc2"), m.fe, h);
                    for c in 0..h {
                        y[c] += pr[e] / ssum * o[c];
                    }
                    count[e] += 1.0;
                }
                for e in 0..ne {
                    psum[e] += pr[e];
                }
                if m.fs > 0 {
                    let o = mlp(dm, &n, w("shared_fc1"), w("shared_fc2"), m.fs, h);
                    for c in 0..h {
                        y[c] += o[c];
                    }
                }
                for c in 0..h {
                    xi[c] += y[c];
                }
            }
            let fp: f64 = (0..ne)
                .map(|e| count[e] / (s * k) as f64 * psum[e] / s as f64)
                .sum();
            aux += coef * ne as f64 * fp / seqs.len() as f64;
        }
        for (i, xi) in x.iter().enumerate() {
            let n = norm(dm, p, xi, "final_norm");
            let logits: Vec<f64> = if dm.tied {
                (0..v)
                    .map(|t| (0..h).map(|c| n[c] * p["embedding"][t * h + c]).sum())
                    .collect()
            } else {
                vm(&n, &p["lm_head"], v)
            };
            let mx = logits.iter().copied().fold(f64::MIN, f64::max);
            let lse = mx + logits.iter().map(|a| (a - mx).exp()).sum::<f64>().ln();
            total += lse - logits[toks[i + 1] as usize];
        }
    }
    (total / (seqs.len() * s) as f64, aux)
}

fn check(tied: bool) {
    check_plan(&common::template(tied, common::LAYERS), "L0.fc2");
}

/// The single-rank step of `tpl` against the naive model; `spot` is the tensor whose
/// AdamW update is checked by hand.
fn check_plan(tpl: &shardwright_spec::Plan, spot: &str) {
    let plan = common::plan_for(tpl, common::layout("ga4"));
    let dims = Dims::from_model(&shardwright_lowering::info::model_info(&plan.inputs)).unwrap();
    let cfg = common::cfg();
    let reps = common::run(&plan, 1);
    let st = &reps[0].steps[0];
    // The same full weights and data.
    let p: P = st
        .grads
        .keys()
        .map(|n| {
            (
                n.clone(),
                dims.init(cfg.seed, n).iter().map(|x| *x as f64).collect(),
            )
        })
        .collect();
    let seqs: Vec<Vec<u32>> = (0..4)
        .map(|g| tokens(cfg.seed, 0, g, dims.seq, dims.vocab))
        .collect();
    let (want, want_aux) = naive_losses(&dims, &p, &seqs, cfg.moe_aux_coef as f64);
    let got = st.loss.unwrap();
    let e = (got - want).abs() / want;
    eprintln!("loss {got} vs naive {want}: rel {e:.2e}");
    assert!(e < 1e-5, "loss {got} vs naive {want}");
    match st.aux_loss {
        Some(got) => {
            let e = (got - want_aux).abs() / want_aux;
            eprintln!("aux loss {got} vs naive {want_aux}: rel {e:.2e}");
            assert!(e < 1e-5, "aux loss {got} vs naive {want_aux}");
        }
        None => assert_eq!(want_aux, 0.0, "no aux loss reported"),
    }

    // Directional derivatives along random directions over every tensor at once.
    let h = 1e-4;
    let mut rng = Rng::new(99);
    for k in 0..3 {
        let dir: P = p
            .iter()
            .map(|(n, v)| {
                (
                    n.clone(),
                    (0..v.len()).map(|_| rng.sym(1.0) as f64).collect(),
                )
            })
            .collect();
        let shift = |sgn: f64| -> P {
            p.iter()
                .map(|(n, v)| {
                    (
                        n.clone(),
                        v.iter()
                            .zip(&dir[n])
                            .map(|(a, b)| a + sgn * h * b)
                            .collect(),
                    )
                })
                .collect()
        };
        let fd = (naive_loss(&dims, &shift(1.0), &seqs) - naive_loss(&dims, &shift(-1.0), &seqs))
            / (2.0 * h);
        let an: f64 = st
            .grads
            .iter()
            .map(|(n, g)| {
                g.iter()
                    .zip(&dir[n])
                    .map(|(a, b)| *a as f64 * b)
                    .sum::<f64>()
            })
            .sum();
        let e = (fd - an).abs() / fd.abs();
        eprintln!("direction {k}: finite difference {fd}, executor {an}: rel {e:.2e}");
        assert!(
            e < 1e-4,
            "direction {k}: finite difference {fd}, executor {an}"
        );
    }
    // Sampled elements of every tensor.
    for (n, g) in &st.grads {
        let scale = g.iter().fold(0.0f64, |m, x| m.max(x.abs() as f64));
        for _ in 0..4 {
            let i = rng.below(g.len() as u64) as usize;
            let mut pp = p.clone();
            pp.get_mut(n).unwrap()[i] += h;
            let mut pm = p.clone();
            pm.get_mut(n).unwrap()[i] -= h;
            let fd = (naive_loss(&dims, &pp, &seqs) - naive_loss(&dims, &pm, &seqs)) / (2.0 * h);
            let e = (fd - g[i] as f64).abs() / scale;
            assert!(
                e < 1e-4,
                "grad {n}[{i}]: finite difference {fd}, executor {} (scale {scale})",
                g[i]
            );
        }
    }
    // The update is AdamW of the (clipped) gradient: spot-check one element.
    let lr = lr_at(&cfg, 0) as f64;
    let n = spot;
    let (g0, p0) = (st.grads[n][3] as f64, p[n][3]);
    let norm = st.grad_norm;
    let c = if norm > cfg.clip as f64 {
        cfg.clip as f64 / (norm + 1e-6)
    } else {
        1.0
    };
    let gc = g0 * c;
    let upd = p0 - lr * (gc / (gc.abs() + cfg.eps as f64) + cfg.weight_decay as f64 * p0);
    assert!(
        (st.params[n][3] as f64 - upd).abs() < 1e-5,
        "AdamW update {} vs {upd}",
        st.params[n][3]
    );
}

#[test]
fn single_rank_step_matches_the_naive_model_untied() {
    check(false);
}

#[test]
fn single_rank_step_matches_the_naive_model_tied() {
    check(true);
}

/// MoE (layer 0 dense, layer 1: 4 experts, top-2, one shared expert): the loss, the
/// load-balancing loss and every gradient (router, experts, shared expert included)
/// against the naive model's value and finite differences of its objective.
#[test]
fn single_rank_moe_step_matches_the_naive_model() {
    check_plan(&common::moe_template(2, 1, 1), "L1.router");
}

/// Every layer MoE, no shared expert.
#[test]
fn single_rank_moe_without_shared_experts_matches_the_naive_model() {
    check_plan(&common::moe_template(2, 0, 0), "L0.e2.expert_fc2");
}

/// The load-balancing loss's own gradient: the router's gradient of `coef` x the aux
/// loss alone, as the difference of two executor runs with different coefficients (the
/// cross-entropy part cancels), against finite differences of the naive aux loss.
#[test]
fn moe_aux_loss_router_gradient_matches_finite_differences() {
    use shardwright_executor::{run_program, Cpu};
    let tpl = common::moe_template(2, 1, 1);
    let plan = common::plan_for(&tpl, common::layout("ga4"));
    let dims = Dims::from_model(&shardwright_lowering::info::model_info(&plan.inputs)).unwrap();
    let lowered = shardwright_lowering::lower(&plan).unwrap();
    let grad = |coef: f32| {
        let cfg = shardwright_executor::ExecConfig {
            moe_aux_coef: coef,
            ..common::cfg()
        };
        let r = run_program(&lowered.program, Cpu, &cfg, 1).unwrap();
        r[0].steps[0].grads["L1.router"].clone()
    };
    let (g0, g1) = (grad(0.0), grad(1.0));
    let ga: Vec<f64> = g1.iter().zip(&g0).map(|(a, b)| (a - b) as f64).collect();
    let cfg = common::cfg();
    let p: P = g_names(&dims)
        .into_iter()
        .map(|n| {
            let v = dims.init(cfg.seed, &n).iter().map(|x| *x as f64).collect();
            (n, v)
        })
        .collect();
    let seqs: Vec<Vec<u32>> = (0..4)
        .map(|g| tokens(cfg.seed, 0, g, dims.seq, dims.vocab))
        .collect();
    let scale = ga.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    assert!(scale > 1e-4, "the aux loss moves the router ({scale})");
    // Small enough that no token's top-k choice flips (f is piecewise constant).
    let h = 1e-6;
    let mut worst = 0.0f64;
    for (i, &want) in ga.iter().enumerate() {
        let mut pp = p.clone();
        pp.get_mut("L1.router").unwrap()[i] += h;
        let mut pm = p.clone();
        pm.get_mut("L1.router").unwrap()[i] -= h;
        let fd = (naive_losses(&dims, &pp, &seqs, 1.0).1 - naive_losses(&dims, &pm, &seqs, 1.0).1)
            / (2.0 * h);
        let e = (fd - want).abs() / scale;
        worst = worst.max(e);
        assert!(
            e < 1e-5,
            "router[{i}]: aux finite difference {fd}, executor {want} (scale {scale})"
        );
    }
    eprintln!("aux router gradient vs finite differences: worst {worst:.2e} of {scale:.3e}");
}

/// Names of every parameter of the single-rank model.
fn g_names(dims: &Dims) -> Vec<String> {
    let mut v = vec!["embedding".to_string(), "final_norm".to_string()];
    if dims.layernorm {
        v.push("final_norm_bias".into());
    }
    if dims.learned_positions {
        v.push("pos_embedding".into());
    }
    if !dims.tied {
        v.push("lm_head".into());
    }
    for l in 0..dims.layers {
        v.extend(dims.layer_params(l));
        v.extend(dims.expert_params(l, 0..dims.moe.as_ref().map_or(0, |m| m.experts)));
    }
    v
}

/// GPT-style blocks (LayerNorm with bias, GeLU MLP, learned positions), tied and untied.
#[test]
fn single_rank_gpt_step_matches_the_naive_model() {
    check_plan(&common::gpt_template(true, 2), "L1.mlp_norm_bias");
    check_plan(&common::gpt_template(false, 2), "pos_embedding");
}
