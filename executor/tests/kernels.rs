//! CPU kernels: every backward against central finite differences of its forward (the
//! scalar `sum(r * y)` for a random cotangent `r`, accumulated in f64), forwards of
//! attention and RMSNorm against textbook formulas written here in f64.

use shardwright_executor::rng::Rng;
use shardwright_executor::{AdamW, AttnSaved, AttnShape, Backend, Cpu, NormGrads};

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

/// Compare `analytic` with central differences of `x -> sum(r * f(x))` at every element.
fn check_grad(
    name: &str,
    x: &[f32],
    r: &[f32],
    analytic: &[f32],
    f: &dyn Fn(&Vec<f32>) -> Vec<f32>,
) {
    assert_eq!(x.len(), analytic.len(), "{name}: gradient length");
    let h = 1e-2f32;
    let scale = analytic
        .iter()
        .fold(0.0f64, |m, v| m.max(v.abs() as f64))
        .max(1e-3);
    let mut worst = 0.0f64;
    for i in 0..x.len() {
        let mut xp = x.to_vec();
        xp[i] += h;
        let mut xm = x.to_vec();
        xm[i] -= h;
        let fd = (dot(&f(&xp), r) - dot(&f(&xm), r)) / (2.0 * h as f64);
        let err = (fd - analytic[i] as f64).abs() / scale;
        worst = worst.max(err);
        assert!(
            err < 5e-3,
            "{name}[{i}]: finite difference {fd}, analytic {} (scale {scale})",
            analytic[i]
        );
    }
    eprintln!("{name}: worst relative error {worst:.2e}");
}

#[test]
fn linear_gradients() {
    let mut g = Rng::new(1);
    let (t, k, n) = (5, 4, 3);
    let x = g.vec(t * k, 1.0);
    let w = g.vec(k * n, 1.0);
    let r = g.vec(t * n, 1.0);
    let cpu = Cpu;
    let y = cpu.linear_fwd(&x, &w, t, k, n);
    for i in 0..t {
        for j in 0..n {
            let e: f64 = (0..k)
                .map(|c| x[i * k + c] as f64 * w[c * n + j] as f64)
                .sum();
            assert!((y[i * n + j] as f64 - e).abs() < 1e-5);
        }
    }
    let dx = cpu.linear_dgrad(&r, &w, t, k, n);
    check_grad("linear.dx", &x, &r, &dx, &|x| {
        cpu.linear_fwd(x, &w, t, k, n)
    });
    let mut dw = vec![0.0; k * n];
    cpu.linear_wgrad(&x, &r, t, k, n, &mut dw);
    check_grad("linear.dw", &w, &r, &dw, &|w| {
        cpu.linear_fwd(&x, w, t, k, n)
    });
}

#[test]
fn embedding_gradients_and_vocab_shards() {
    let mut g = Rng::new(2);
    let (v, h) = (7, 3);
    let table = g.vec(v * h, 1.0);
    let ids = [0u32, 3, 6, 3, 5];
    let cpu = Cpu;
    let r = g.vec(ids.len() * h, 1.0);
    let mut dt = vec![0.0; v * h];
    cpu.embedding_bwd(&ids, &r, 0, h, &mut dt);
    check_grad("embedding.dtable", &table, &r, &dt, &|tb| {
        cpu.embedding_fwd(&ids, tb, 0, h)
    });
    // Two vocabulary shards sum to the whole table's lookup.
    let a = cpu.embedding_fwd(&ids, &table[..4 * h].to_vec(), 0, h);
    let b = cpu.embedding_fwd(&ids, &table[4 * h..].to_vec(), 4, h);
    let full = cpu.embedding_fwd(&ids, &table, 0, h);
    for i in 0..full.len() {
        assert_eq!(a[i] + b[i], full[i]);
    }
}

#[test]
fn rmsnorm_forward_and_gradients() {
    let mut g = Rng::new(3);
    let (t, h) = (4, 6);
    let x = g.vec(t * h, 1.0);
    let w = g.vec(h, 1.0);
    let eps = 1e-5;
    let cpu = Cpu;
    let (y, rstd) = cpu.rmsnorm_fwd(&x, &w, h, eps);
    for i in 0..t {
        let ms: f64 = (0..h).map(|j| (x[i * h + j] as f64).powi(2)).sum::<f64>() / h as f64;
        for j in 0..h {
            let e = x[i * h + j] as f64 / (ms + eps as f64).sqrt() * w[j] as f64;
            assert!((y[i * h + j] as f64 - e).abs() < 1e-5, "rmsnorm y");
        }
    }
    let r = g.vec(t * h, 1.0);
    let mut dw = vec![0.0; h];
    let dx = cpu.rmsnorm_bwd(&x, &w, &rstd, &r, h, &mut dw);
    check_grad("rmsnorm.dx", &x, &r, &dx, &|x| {
        cpu.rmsnorm_fwd(x, &w, h, eps).0
    });
    check_grad("rmsnorm.dw", &w, &r, &dw, &|w| {
        cpu.rmsnorm_fwd(&x, w, h, eps).0
    });
}

#[test]
fn rope_gradient_and_norm_preservation() {
    let mut g = Rng::new(4);
    let (t, heads, d) = (3, 2, 8);
    let x = g.vec(t * heads * d, 1.0);
    let pos = [0u32, 5, 17];
    let cpu = Cpu;
    let fwd = |x: &Vec<f32>| {
        let mut y = x.to_vec();
        cpu.rope_fwd(&mut y, &pos, heads, d, 10000.0);
        y
    };
    let y = fwd(&x);
    // A rotation keeps each pair's length; position 0 is the identity.
    assert!((dot(&x, &x) - dot(&y, &y)).abs() < 1e-4);
    assert_eq!(&y[..heads * d], &x[..heads * d]);
    let r = g.vec(x.len(), 1.0);
    let mut dx = r.clone();
    cpu.rope_bwd(&mut dx, &pos, heads, d, 10000.0);
    check_grad("rope.dx", &x, &r, &dx, &fwd);
}

/// softmax(q k^T / sqrt(d)) v with a causal mask, naive f64.
fn naive_attention(q: &[f32], k: &[f32], v: &[f32], s: AttnShape) -> Vec<f64> {
    let (hq, hk, d) = (s.heads, s.kv_heads, s.head_dim);
    let mut o = vec![0.0; s.batch * s.seq_q * hq * d];
    for b in 0..s.batch {
        for h in 0..hq {
            let kh = h * hk / hq;
            for i in 0..s.seq_q {
                let qp = s.q_offset + i;
                let mut scores = Vec::new();
                for j in 0..s.seq_kv {
                    if s.causal && j > qp {
                        continue;
                    }
                    let mut sc = 0.0;
                    for c in 0..d {
                        sc += q[((b * s.seq_q + i) * hq + h) * d + c] as f64
                            * k[((b * s.seq_kv + j) * hk + kh) * d + c] as f64;
                    }
                    scores.push((j, sc / (d as f64).sqrt()));
                }
                let mx = scores.iter().map(|x| x.1).fold(f64::MIN, f64::max);
                let z: f64 = scores.iter().map(|x| (x.1 - mx).exp()).sum();
                for (j, sc) in scores {
                    let p = (sc - mx).exp() / z;
                    for c in 0..d {
                        o[((b * s.seq_q + i) * hq + h) * d + c] +=
                            p * v[((b * s.seq_kv + j) * hk + kh) * d + c] as f64;
                    }
                }
            }
        }
    }
    o
}

#[test]
fn attention_forward_matches_textbook_and_gradients_match_finite_differences() {
    let mut g = Rng::new(5);
    for &(seq_q, seq_kv, q_offset, causal) in &[(5, 5, 0, true), (3, 6, 3, true), (4, 4, 0, false)]
    {
        let s = AttnShape {
            batch: 2,
            seq_q,
            seq_kv,
            heads: 4,
            kv_heads: 2,
            head_dim: 4,
            q_offset,
            causal,
        };
        let q = g.vec(s.batch * seq_q * s.heads * s.head_dim, 1.0);
        let k = g.vec(s.batch * seq_kv * s.kv_heads * s.head_dim, 1.0);
        let v = g.vec(k.len(), 1.0);
        let cpu = Cpu;
        let (o, lse) = cpu.attention_fwd(&q, &k, &v, s);
        let e = naive_attention(&q, &k, &v, s);
        for i in 0..o.len() {
            assert!((o[i] as f64 - e[i]).abs() < 1e-5, "attention o[{i}] {s:?}");
        }
        let r = g.vec(o.len(), 1.0);
        let (dq, dk, dv) = cpu.attention_bwd(
            AttnSaved {
                q: &q,
                k: &k,
                v: &v,
                o: &o,
                lse: &lse,
            },
            &r,
            s,
        );
        check_grad("attention.dq", &q, &r, &dq, &|q| {
            cpu.attention_fwd(q, &k, &v, s).0
        });
        check_grad("attention.dk", &k, &r, &dk, &|k| {
            cpu.attention_fwd(&q, k, &v, s).0
        });
        check_grad("attention.dv", &v, &r, &dv, &|v| {
            cpu.attention_fwd(&q, &k, v, s).0
        });
    }
}

#[test]
fn context_parallel_chunks_of_attention_equal_the_whole() {
    // Queries split into two chunks, each attending to the whole K/V with its offset.
    let mut g = Rng::new(6);
    let s = AttnShape {
        batch: 1,
        seq_q: 8,
        seq_kv: 8,
        heads: 2,
        kv_heads: 1,
        head_dim: 4,
        q_offset: 0,
        causal: true,
    };
    let q = g.vec(8 * 2 * 4, 1.0);
    let k = g.vec(8 * 4, 1.0);
    let v = g.vec(8 * 4, 1.0);
    let cpu = Cpu;
    let whole = cpu.attention_fwd(&q, &k, &v, s).0;
    for c in 0..2 {
        let sc = AttnShape {
            seq_q: 4,
            q_offset: 4 * c,
            ..s
        };
        let part = cpu
            .attention_fwd(&q[c * 32..(c + 1) * 32].to_vec(), &k, &v, sc)
            .0;
        assert_eq!(&part[..], &whole[c * 32..(c + 1) * 32]);
    }
}

#[test]
fn swiglu_gradient() {
    let mut g = Rng::new(7);
    let (t, f) = (3, 4);
    let gu = g.vec(t * 2 * f, 2.0);
    let r = g.vec(t * f, 1.0);
    let cpu = Cpu;
    let d = cpu.swiglu_bwd(&gu, &r, f);
    check_grad("swiglu.dgu", &gu, &r, &d, &|x| cpu.swiglu_fwd(x, f));
}

#[test]
fn cross_entropy_value_gradient_and_vocab_shards() {
    let mut g = Rng::new(8);
    let (t, v) = (4, 6);
    let logits = g.vec(t * v, 2.0);
    let targets = [0u32, 5, 2, 3];
    let cpu = Cpu;
    let loss = |lg: &Vec<f32>| -> Vec<f32> {
        let (lse, tg) = cpu.xent_local(lg, &targets, v, 0);
        lse.iter().zip(&tg).map(|(a, b)| a - b).collect()
    };
    let l = loss(&logits);
    for i in 0..t {
        let row = &logits[i * v..(i + 1) * v];
        let z: f64 = row.iter().map(|x| (*x as f64).exp()).sum();
        let e = z.ln() - row[targets[i] as usize] as f64;
        assert!((l[i] as f64 - e).abs() < 1e-5);
    }
    let r = g.vec(t, 1.0);
    let (lse, _) = cpu.xent_local(&logits, &targets, v, 0);
    // Per-token scale r[i]: the backward with a scalar scale, row by row.
    let mut d = Vec::new();
    for i in 0..t {
        d.extend(cpu.xent_bwd(
            &logits[i * v..(i + 1) * v].to_vec(),
            &targets[i..i + 1],
            &lse[i..i + 1].to_vec(),
            v,
            0,
            r[i],
        ));
    }
    check_grad("xent.dlogits", &logits, &r, &d, &loss);
    // Two shards: combined log-sum-exp and target logits equal the whole.
    let (la, ta) = {
        let sh: Vec<f32> = (0..t)
            .flat_map(|i| logits[i * v..i * v + 2].to_vec())
            .collect();
        cpu.xent_local(&sh, &targets, 2, 0)
    };
    let (lb, tb) = {
        let sh: Vec<f32> = (0..t)
            .flat_map(|i| logits[i * v + 2..(i + 1) * v].to_vec())
            .collect();
        cpu.xent_local(&sh, &targets, 4, 2)
    };
    for i in 0..t {
        let m = la[i].max(lb[i]);
        let lse2 = m + ((la[i] - m).exp() + (lb[i] - m).exp()).ln();
        assert!((lse2 - lse[i]).abs() < 1e-5);
        assert!(((ta[i] + tb[i]) - (lse[i] - l[i])).abs() < 1e-5);
    }
}

#[test]
fn adamw_matches_the_formula() {
    let cpu = Cpu;
    let mut p = vec![1.0f32, -2.0];
    let g = vec![0.5f32, -0.25];
    let mut m = vec![0.0; 2];
    let mut v = vec![0.0; 2];
    let h = AdamW {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 1,
    };
    cpu.adamw(&mut p, &g, &mut m, &mut v, h);
    // Step 1: m_hat = g, v_hat = g^2, so the update is lr * (sign(g) + wd * p).
    let e0 = 1.0 - 0.1 * (1.0 + 0.1 * 1.0);
    let e1 = -2.0 - 0.1 * (-1.0 + 0.1 * -2.0);
    assert!(
        (p[0] as f64 - e0).abs() < 1e-6 && (p[1] as f64 - e1).abs() < 1e-6,
        "{p:?}"
    );
}

/// Top-k routing: probabilities, choice and gates against a hand computation; ties go to
/// the lower expert index; the backward (through the gates and directly through the
/// probabilities) against finite differences with the choice held (logits far apart).
#[test]
fn routing_forward_and_gradients() {
    let cpu = Cpu;
    // One token, 4 experts: softmax of (0, ln 2, ln 4, ln 1) = (1, 2, 4, 1) / 8.
    let l = vec![0.0f32, 2f32.ln(), 4f32.ln(), 0.0];
    let r = cpu.route(&l, 4, 2);
    let want = [0.125f32, 0.25, 0.5, 0.125];
    for (a, b) in r.probs.iter().zip(want) {
        assert!((a - b).abs() < 1e-6, "{:?}", r.probs);
    }
    assert_eq!(r.experts, vec![2, 1]);
    assert!((r.gates[0] - 2.0 / 3.0).abs() < 1e-6 && (r.gates[1] - 1.0 / 3.0).abs() < 1e-6);
    // Ties: experts 0 and 3 equal, the lower index first.
    let r = cpu.route(&l, 4, 3);
    assert_eq!(r.experts, vec![2, 1, 0]);
    let r = cpu.route(&vec![1.0, 1.0, 1.0, 1.0], 4, 2);
    assert_eq!(r.experts, vec![0, 1]);
    assert_eq!(r.gates, vec![0.5, 0.5]);

    // Gradients: 3 tokens, 5 experts, top-2; logits spaced 0.7 apart in a random order.
    let (t, e, k) = (3, 5, 2);
    let mut g = Rng::new(11);
    let mut logits = Vec::new();
    for i in 0..t {
        let mut row: Vec<f32> = (0..e)
            .map(|j| 0.7 * j as f32 - 1.0 + 0.1 * i as f32)
            .collect();
        for j in (1..e).rev() {
            row.swap(j, g.below(j as u64 + 1) as usize);
        }
        logits.extend(row);
    }
    let base = cpu.route(&logits, e, k);
    let rg = g.vec(t * k, 1.0);
    let rp = g.vec(t * e, 1.0);
    let mut cot = rg.clone();
    cot.extend_from_slice(&rp);
    let dl = cpu.route_bwd(&base, &rg, &rp, e, k);
    check_grad("route.dlogits", &logits, &cot, &dl, &|x| {
        let r = cpu.route(x, e, k);
        assert_eq!(r.experts, base.experts, "the choice flipped");
        let mut out = r.gates;
        out.extend(r.probs);
        out
    });
}

/// LayerNorm against the textbook formula in f64; its backward (x, weight, bias) and
/// GeLU's against finite differences.
#[test]
fn layernorm_and_gelu() {
    let cpu = Cpu;
    let mut g = Rng::new(12);
    let (t, h) = (3, 6);
    let x = g.vec(t * h, 2.0);
    let w: Vec<f32> = (0..h).map(|_| 1.0 + g.sym(0.3)).collect();
    let b = g.vec(h, 0.5);
    let (y, st) = cpu.layernorm_fwd(&x, &w, &b, h, 1e-5);
    for i in 0..t {
        let row: Vec<f64> = x[i * h..(i + 1) * h].iter().map(|v| *v as f64).collect();
        let m = row.iter().sum::<f64>() / h as f64;
        let var = row.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / h as f64;
        for j in 0..h {
            let e = (row[j] - m) / (var + 1e-5).sqrt() * w[j] as f64 + b[j] as f64;
            assert!((y[i * h + j] as f64 - e).abs() < 1e-5, "layernorm[{i},{j}]");
        }
    }
    let r = g.vec(t * h, 1.0);
    let mut dw = vec![0.0; h];
    let mut db = vec![0.0; h];
    let dx = cpu.layernorm_bwd(
        &x,
        &w,
        &st,
        &r,
        h,
        NormGrads {
            dw: &mut dw,
            db: &mut db,
        },
    );
    check_grad("layernorm.dx", &x, &r, &dx, &|x| {
        cpu.layernorm_fwd(x, &w, &b, h, 1e-5).0
    });
    check_grad("layernorm.dw", &w, &r, &dw, &|w| {
        cpu.layernorm_fwd(&x, w, &b, h, 1e-5).0
    });
    check_grad("layernorm.db", &b, &r, &db, &|b| {
        cpu.layernorm_fwd(&x, &w, b, h, 1e-5).0
    });
    // GeLU: known values (tanh form) and the gradient.
    let v = cpu.gelu_fwd(&vec![0.0, 1.0, -1.0]);
    assert!(
        v[0] == 0.0 && (v[1] - 0.841_192).abs() < 1e-5 && (v[2] + 0.158_808).abs() < 1e-5,
        "{v:?}"
    );
    let x = g.vec(10, 3.0);
    let r = g.vec(10, 1.0);
    let dx = cpu.gelu_bwd(&x, &r);
    check_grad("gelu.dx", &x, &r, &dx, &|x| cpu.gelu_fwd(x));
}

/// The buffer primitives the interpreter moves tensors with, each against its definition
/// on host vectors, through upload and download only (so a device backend can run the
/// same checks).
fn buffer_primitives<B: Backend>(be: &B) {
    let host: Vec<f32> = (0..12).map(|i| i as f32 - 3.5).collect();
    let x = be.upload(&host);
    assert_eq!(be.len(&x), 12);
    assert_eq!(be.download(&x), host);
    assert_eq!(be.download(&be.copy(&x)), host);
    assert_eq!(be.download(&be.zeros(3)), vec![0.0; 3]);
    assert_eq!(be.download(&be.slice(&x, 2, 5)), host[2..5].to_vec());
    let y = be.upload(&[10.0, 20.0]);
    let cat = [&host[..], &[10.0, 20.0]].concat();
    assert_eq!(be.download(&be.concat(&[&x, &y])), cat);
    // Columns 1..3 of x as a 3 x 4 matrix.
    let cols = be.gather(&x, &[(1, 2), (5, 2), (9, 2)]);
    assert_eq!(be.download(&cols), vec![-2.5, -1.5, 1.5, 2.5, 5.5, 6.5]);

    let mut d = be.zeros(6);
    be.write(&mut d, 4, &[7.0, 8.0]);
    be.copy_ranges(&mut d, &x, 2, &[(10, 0), (0, 2)]);
    assert_eq!(be.download(&d), vec![6.5, 7.5, -3.5, -2.5, 7.0, 8.0]);
    be.scale_ranges(&mut d, &x, 2, &[(0, 0, 2.0)]);
    assert_eq!(be.download(&d)[..2], [-7.0, -5.0]);
    // Repeated destinations add up in order.
    be.axpy_ranges(&mut d, &x, 2, &[(4, 2, 1.0), (4, 2, 0.5)]);
    assert_eq!(
        be.download(&d)[2..4],
        [-3.5 + 0.5 + 0.25, -2.5 + 1.5 + 0.75]
    );
    be.add_into(&mut d, 4, &y);
    assert_eq!(be.download(&d)[4..], [17.0, 28.0]);
    be.fill_zero(&mut d);
    assert_eq!(be.download(&d), vec![0.0; 6]);

    let sum: Vec<f32> = host.iter().map(|v| v + v).collect();
    assert_eq!(be.download(&be.add(&x, &x)), sum);
    let half: Vec<f32> = host.iter().map(|v| v * 0.5).collect();
    assert_eq!(be.download(&be.scale(&x, 0.5)), half);
    // <x[0..3], x[3..6]> and <x[6..9], x[0..3]>.
    let dots = be.download(&be.dots(&x, &x, 3, &[(0, 3), (6, 0)]));
    let dot3 = |i: usize, j: usize| (0..3).map(|n| host[i + n] * host[j + n]).sum::<f32>();
    assert_eq!(dots, vec![dot3(0, 3), dot3(6, 0)]);
    assert_eq!(be.download(&be.row_max(&x, 4)), vec![-0.5, 3.5, 7.5]);
}

#[test]
fn cpu_buffer_primitives() {
    buffer_primitives(&Cpu);
}

/// The row kernels (SwiGLU, the loss) at a size the pool cuts into row blocks equal the
/// textbook, row by row, written here serially in f64.
#[test]
fn row_blocked_kernels_equal_the_serial_textbook() {
    let cpu = Cpu;
    let (t, f, v) = (700, 96, 300);
    let wave = |n: usize, a: f32| {
        (0..n)
            .map(|i| ((i as f32) * a).sin() * 3.0)
            .collect::<Vec<_>>()
    };
    let gu = wave(t * 2 * f, 0.37);
    let dy = wave(t * f, 0.11);
    let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
    let y = cpu.swiglu_fwd(&gu, f);
    let d = cpu.swiglu_bwd(&gu, &dy, f);
    for i in (0..t).step_by(37) {
        for j in 0..f {
            let (g, u) = (gu[i * 2 * f + j] as f64, gu[i * 2 * f + f + j] as f64);
            let want = g * sig(g) * u;
            assert!(
                (y[i * f + j] as f64 - want).abs() < 1e-5 * (1.0 + want.abs()),
                "y[{i},{j}]"
            );
            let e = dy[i * f + j] as f64;
            let dg = e * u * sig(g) * (1.0 + g * (1.0 - sig(g)));
            let du = e * g * sig(g);
            assert!(
                (d[i * 2 * f + j] as f64 - dg).abs() < 1e-4 * (1.0 + dg.abs()),
                "dg[{i},{j}]"
            );
            assert!(
                (d[i * 2 * f + f + j] as f64 - du).abs() < 1e-4 * (1.0 + du.abs()),
                "du[{i},{j}]"
            );
        }
    }
    let logits = wave(t * v, 0.013);
    let targets: Vec<u32> = (0..t as u32).map(|i| (i * 7) % v as u32).collect();
    let (lse, tgt) = cpu.xent_local(&logits, &targets, v, 0);
    let scale = 0.5f32;
    let dl = cpu.xent_bwd(&logits, &targets, &lse, v, 0, scale);
    for i in (0..t).step_by(29) {
        let row: Vec<f64> = logits[i * v..(i + 1) * v]
            .iter()
            .map(|&x| x as f64)
            .collect();
        let want = row.iter().map(|x| x.exp()).sum::<f64>().ln();
        assert!((lse[i] as f64 - want).abs() < 1e-4, "lse[{i}]");
        assert_eq!(
            tgt[i],
            logits[i * v + targets[i] as usize],
            "target logit of row {i}"
        );
        for j in 0..v {
            let p = (row[j] - want).exp() - if j == targets[i] as usize { 1.0 } else { 0.0 };
            assert!(
                (dl[i * v + j] as f64 - scale as f64 * p).abs() < 1e-5,
                "dlogits[{i},{j}]"
            );
        }
    }
}
