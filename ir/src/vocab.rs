//! The project's shared vocabulary: mesh axes, parameter roles and GEMM roles as enums,
//! parameter names, and a rank's coordinates on the mesh.
//!
//! Every crate that names a process group's axis (the mesh in `spec`, the cost model, the
//! lowering, the executor) uses [`Axis`]; every crate that names a parameter's role (the
//! cost model's layer template, the lowering's weights, the executor's shapes and splits)
//! uses [`Role`], a GEMM's product [`GemmRole`] and [`GemmName`], a parameter's name
//! [`ParamName`]. The text forms print `name()` and parsing an unknown name is an error
//! listing the known ones, never a default. Outside this module no crate matches a role
//! by its string (`ir/tests/role_literals.rs` checks it).

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// A mesh axis, or the product of axes a process group spans.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Axis {
    /// Tensor parallel.
    Tp,
    /// Context parallel.
    Cp,
    /// Expert parallel.
    Ep,
    /// Data parallel (the `dp` mesh dimension alone).
    Dp,
    /// Pipeline parallel.
    Pp,
    /// cp x ep x dp: the ranks holding replicas of the same dense parameters.
    DenseDp,
    /// cp x dp: the ranks holding replicas of the same experts.
    ExpertDp,
    /// Every rank (the clipping norm's all-reduce).
    World,
}

impl Axis {
    pub const ALL: [Axis; 8] = [
        Axis::Tp,
        Axis::Cp,
        Axis::Ep,
        Axis::Dp,
        Axis::Pp,
        Axis::DenseDp,
        Axis::ExpertDp,
        Axis::World,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Axis::Tp => "tp",
            Axis::Cp => "cp",
            Axis::Ep => "ep",
            Axis::Dp => "dp",
            Axis::Pp => "pp",
            Axis::DenseDp => "dense_dp",
            Axis::ExpertDp => "expert_dp",
            Axis::World => "world",
        }
    }
}

/// `Display` (its `name()`) and `FromStr` (one of its `ALL` by name, else the "unknown X
/// (one of a, b, c)" error) of a vocabulary enum.
macro_rules! named {
    ($t:ty, $what:literal) => {
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }

        impl FromStr for $t {
            type Err = String;
            fn from_str(s: &str) -> Result<$t, String> {
                <$t>::ALL
                    .into_iter()
                    .find(|x| x.name() == s)
                    .ok_or_else(|| unknown($what, s, <$t>::ALL.iter().map(|x| x.name())))
            }
        }
    };
}

named!(Axis, "axis");

/// The "unknown X (one of a, b, c)" error of a vocabulary's `FromStr`.
fn unknown(what: &str, s: &str, names: impl Iterator<Item = &'static str>) -> String {
    let names: Vec<&str> = names.collect();
    format!("unknown {what} {s:?} (one of {})", names.join(", "))
}

/// A parameter's role in the model: what the tensor is, whatever layer or expert it
/// belongs to. Its name is the last component of a parameter's name (`qkv` of `L3.qkv`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Token embedding `[vocab, h]` (vocabulary-parallel); the LM head's weight when tied.
    Embedding,
    /// Learned absolute positions `[seq, h]` (GPT style).
    PosEmbedding,
    /// The attention block's norm weight `[h]`.
    AttnNorm,
    /// Its bias (LayerNorm only).
    AttnNormBias,
    /// Fused Q, K, V projection `[h, (heads + 2 kv_heads) d]` (column-parallel per block).
    Qkv,
    /// Attention output projection `[heads d, h]` (row-parallel).
    Proj,
    /// The MLP block's norm weight `[h]`.
    MlpNorm,
    /// Its bias (LayerNorm only).
    MlpNormBias,
    /// Dense MLP up projection (gate and up for a gated activation; column-parallel).
    Fc1,
    /// Dense MLP down projection (row-parallel).
    Fc2,
    /// MoE router `[h, experts]` (replicated over tp).
    Router,
    /// A routed expert's up projection.
    ExpertFc1,
    /// A routed expert's down projection.
    ExpertFc2,
    /// The shared experts' up projection (one MLP of their summed width).
    SharedFc1,
    /// The shared experts' down projection.
    SharedFc2,
    /// The final norm's weight `[h]`.
    FinalNorm,
    /// Its bias (LayerNorm only).
    FinalNormBias,
    /// Untied LM head `[h, vocab]` (vocabulary-parallel columns).
    LmHead,
}

/// How a parameter of a role is split over tensor-parallel ranks (the blocks of a
/// column split, e.g. Q, K and V of `qkv`, are the model's dimensions, not the role's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TpSplit {
    /// Every tp rank holds the whole tensor.
    Replicated,
    /// Contiguous row blocks (row-parallel GEMMs, the vocabulary-parallel embedding).
    Rows,
    /// Column blocks (column-parallel GEMMs, the vocabulary-parallel head).
    Cols,
}

impl Role {
    pub const ALL: [Role; 18] = [
        Role::Embedding,
        Role::PosEmbedding,
        Role::AttnNorm,
        Role::AttnNormBias,
        Role::Qkv,
        Role::Proj,
        Role::MlpNorm,
        Role::MlpNormBias,
        Role::Fc1,
        Role::Fc2,
        Role::Router,
        Role::ExpertFc1,
        Role::ExpertFc2,
        Role::SharedFc1,
        Role::SharedFc2,
        Role::FinalNorm,
        Role::FinalNormBias,
        Role::LmHead,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Role::Embedding => "embedding",
            Role::PosEmbedding => "pos_embedding",
            Role::AttnNorm => "attn_norm",
            Role::AttnNormBias => "attn_norm_bias",
            Role::Qkv => "qkv",
            Role::Proj => "proj",
            Role::MlpNorm => "mlp_norm",
            Role::MlpNormBias => "mlp_norm_bias",
            Role::Fc1 => "fc1",
            Role::Fc2 => "fc2",
            Role::Router => "router",
            Role::ExpertFc1 => "expert_fc1",
            Role::ExpertFc2 => "expert_fc2",
            Role::SharedFc1 => "shared_fc1",
            Role::SharedFc2 => "shared_fc2",
            Role::FinalNorm => "final_norm",
            Role::FinalNormBias => "final_norm_bias",
            Role::LmHead => "lm_head",
        }
    }

    /// A routed expert's weight: one per expert (`L3.e5.expert_fc1`), split over ep and
    /// reduced over `expert_dp`.
    pub fn is_expert(self) -> bool {
        matches!(self, Role::ExpertFc1 | Role::ExpertFc2)
    }

    /// Whether a parameter of this role belongs to a transformer layer (`L3.qkv`), else to
    /// the model's ends (`embedding`, `final_norm`, `lm_head`).
    pub fn in_layer(self) -> bool {
        !matches!(
            self,
            Role::Embedding
                | Role::PosEmbedding
                | Role::FinalNorm
                | Role::FinalNormBias
                | Role::LmHead
        )
    }

    /// A norm's weight (`attn_norm`, `mlp_norm`, `final_norm`).
    pub fn is_norm(self) -> bool {
        matches!(self, Role::AttnNorm | Role::MlpNorm | Role::FinalNorm)
    }

    /// A norm's bias (LayerNorm only).
    pub fn is_bias(self) -> bool {
        matches!(
            self,
            Role::AttnNormBias | Role::MlpNormBias | Role::FinalNormBias
        )
    }

    /// One-dimensional (`[h]`): the norms' weights and biases, which Megatron's AdamW
    /// does not decay.
    pub fn is_vector(self) -> bool {
        self.is_norm() || self.is_bias()
    }

    /// The bias of a norm's weight (`attn_norm` -> `attn_norm_bias`); None for the rest.
    pub fn norm_bias(self) -> Option<Role> {
        match self {
            Role::AttnNorm => Some(Role::AttnNormBias),
            Role::MlpNorm => Some(Role::MlpNormBias),
            Role::FinalNorm => Some(Role::FinalNormBias),
            _ => None,
        }
    }

    /// How it is split over tensor-parallel ranks (Megatron's layout: column-parallel up
    /// projections and head, row-parallel down projections and embedding, the rest whole).
    pub fn tp_split(self) -> TpSplit {
        match self {
            Role::Embedding | Role::Proj | Role::Fc2 | Role::ExpertFc2 | Role::SharedFc2 => {
                TpSplit::Rows
            }
            Role::Qkv | Role::Fc1 | Role::ExpertFc1 | Role::SharedFc1 | Role::LmHead => {
                TpSplit::Cols
            }
            Role::PosEmbedding
            | Role::AttnNorm
            | Role::AttnNormBias
            | Role::MlpNorm
            | Role::MlpNormBias
            | Role::Router
            | Role::FinalNorm
            | Role::FinalNormBias => TpSplit::Replicated,
        }
    }
}

named!(Role, "parameter role");

/// What a GEMM node multiplies: the forward product of a weight of its role with the
/// whole weight, or (torchtitan's op-level recompute) with a part of one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GemmRole {
    Qkv,
    /// The K projection alone: the K columns of `qkv` (torchtitan's op-level recompute
    /// reruns `wk`).
    KProj,
    Proj,
    Fc1,
    /// The up half of a gated `fc1` (torchtitan's op-level recompute reruns `w3`).
    Fc1Up,
    Fc2,
    Router,
    /// The local experts' grouped up projection.
    ExpertFc1,
    /// The local experts' grouped down projection.
    ExpertFc2,
    SharedFc1,
    SharedFc2,
    /// The LM head (on the embedding when tied).
    LmHead,
}

impl GemmRole {
    pub const ALL: [GemmRole; 12] = [
        GemmRole::Qkv,
        GemmRole::KProj,
        GemmRole::Proj,
        GemmRole::Fc1,
        GemmRole::Fc1Up,
        GemmRole::Fc2,
        GemmRole::Router,
        GemmRole::ExpertFc1,
        GemmRole::ExpertFc2,
        GemmRole::SharedFc1,
        GemmRole::SharedFc2,
        GemmRole::LmHead,
    ];

    pub fn name(self) -> &'static str {
        match self {
            GemmRole::KProj => "k_proj",
            GemmRole::Fc1Up => "fc1_up",
            r => r.weight().name(),
        }
    }

    /// The role of the weight it reads (`k_proj` reads `qkv`; the head reads `lm_head`,
    /// or the embedding when tied: that is the model's choice, not the GEMM's).
    pub fn weight(self) -> Role {
        match self {
            GemmRole::Qkv | GemmRole::KProj => Role::Qkv,
            GemmRole::Proj => Role::Proj,
            GemmRole::Fc1 | GemmRole::Fc1Up => Role::Fc1,
            GemmRole::Fc2 => Role::Fc2,
            GemmRole::Router => Role::Router,
            GemmRole::ExpertFc1 => Role::ExpertFc1,
            GemmRole::ExpertFc2 => Role::ExpertFc2,
            GemmRole::SharedFc1 => Role::SharedFc1,
            GemmRole::SharedFc2 => Role::SharedFc2,
            GemmRole::LmHead => Role::LmHead,
        }
    }

    /// The GEMM with the whole weight of `role`; None for a role no GEMM multiplies by
    /// (norms, biases, the embedding tables).
    pub fn of(role: Role) -> Option<GemmRole> {
        GemmRole::ALL
            .into_iter()
            .find(|g| g.weight() == role && !g.is_partial())
    }

    /// Whether it multiplies by a part of its weight only.
    pub fn is_partial(self) -> bool {
        matches!(self, GemmRole::KProj | GemmRole::Fc1Up)
    }

    /// The routed experts' grouped GEMMs.
    pub fn is_expert(self) -> bool {
        self.weight().is_expert()
    }
}

named!(GemmRole, "gemm role");

/// Which product a GEMM node computes: the forward (`qkv`), the data gradient
/// (`qkv.dgrad`: `dy W^T`) or the weight gradient (`qkv.wgrad`: `x^T dy`, accumulated).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GemmPass {
    Fwd,
    Dgrad,
    Wgrad,
}

impl GemmPass {
    pub const ALL: [GemmPass; 3] = [GemmPass::Fwd, GemmPass::Dgrad, GemmPass::Wgrad];

    /// The suffix of a GEMM node's name (`""`, `".dgrad"`, `".wgrad"`).
    pub fn suffix(self) -> &'static str {
        match self {
            GemmPass::Fwd => "",
            GemmPass::Dgrad => ".dgrad",
            GemmPass::Wgrad => ".wgrad",
        }
    }
}

/// A GEMM node's name: its role and product, printed `qkv`, `qkv.dgrad`, `qkv.wgrad`
/// (serialized as that string).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GemmName {
    pub role: GemmRole,
    pub pass: GemmPass,
}

impl GemmName {
    pub fn new(role: GemmRole, pass: GemmPass) -> GemmName {
        GemmName { role, pass }
    }
    /// The forward product of `role`.
    pub fn fwd(role: GemmRole) -> GemmName {
        GemmName::new(role, GemmPass::Fwd)
    }
}

impl fmt::Display for GemmName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.role.name())?;
        f.write_str(self.pass.suffix())
    }
}

impl FromStr for GemmName {
    type Err = String;
    fn from_str(s: &str) -> Result<GemmName, String> {
        let (role, pass) = [GemmPass::Dgrad, GemmPass::Wgrad]
            .into_iter()
            .find_map(|p| s.strip_suffix(p.suffix()).map(|r| (r, p)))
            .unwrap_or((s, GemmPass::Fwd));
        Ok(GemmName::new(role.parse()?, pass))
    }
}

impl Serialize for GemmName {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for GemmName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<GemmName, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Which expert a routed expert's parameter belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Expert {
    /// The rank's `i`-th local expert (`le{i}`): how a program names a rank class's experts,
    /// since every ep rank of the class runs the same graph on its own experts.
    Local(u32),
    /// Global expert `j` (`e{j}`): how a rank keys its state and checkpoints.
    Global(u32),
}

/// A parameter's name: `{role}` for the model's ends, `L{layer}.{role}` in a layer,
/// `L{layer}.e{j}.{role}` / `L{layer}.le{i}.{role}` for a routed expert's (a GEMM over
/// all local experts names its weight `L{layer}.{role}`). The one parser of parameter
/// names: the lowering prints them, the executor keys its state and checkpoints by them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ParamName {
    pub layer: Option<u32>,
    pub expert: Option<Expert>,
    pub role: Role,
}

impl ParamName {
    /// A parameter of the ends (`embedding`).
    pub fn ends(role: Role) -> ParamName {
        ParamName {
            layer: None,
            expert: None,
            role,
        }
    }
    /// A parameter of layer `l` (`L3.qkv`).
    pub fn layer(l: u32, role: Role) -> ParamName {
        ParamName {
            layer: Some(l),
            expert: None,
            role,
        }
    }
    /// `role` in layer `l` if given, else of the ends.
    pub fn at(layer: Option<u32>, role: Role) -> ParamName {
        ParamName {
            layer,
            expert: None,
            role,
        }
    }
    /// Expert `e`'s parameter of layer `l`.
    pub fn expert(l: u32, e: Expert, role: Role) -> ParamName {
        ParamName {
            layer: Some(l),
            expert: Some(e),
            role,
        }
    }
}

impl fmt::Display for ParamName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(l) = self.layer {
            write!(f, "L{l}.")?;
        }
        match self.expert {
            Some(Expert::Local(i)) => write!(f, "le{i}.")?,
            Some(Expert::Global(j)) => write!(f, "e{j}.")?,
            None => {}
        }
        f.write_str(self.role.name())
    }
}

/// A decimal index without sign or leading zeros (so a name prints back the same).
fn index(s: &str) -> Option<u32> {
    let ok =
        !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0'));
    ok.then(|| s.parse().ok()).flatten()
}

impl FromStr for ParamName {
    type Err = String;
    fn from_str(s: &str) -> Result<ParamName, String> {
        let bad = |why: &str| format!("parameter name {s:?}: {why}");
        let parts: Vec<&str> = s.split('.').collect();
        let (layer, expert, role) = match parts[..] {
            [r] => (None, None, r),
            [l, r] => (Some(l), None, r),
            [l, e, r] => (Some(l), Some(e), r),
            _ => {
                return Err(bad(
                    "not `role`, `L<layer>.role` or `L<layer>.e<expert>.role`",
                ))
            }
        };
        let role: Role = role.parse().map_err(|e: String| bad(&e))?;
        let layer = match layer {
            Some(l) => Some(
                l.strip_prefix('L')
                    .and_then(index)
                    .ok_or_else(|| bad("the layer is not `L<index>`"))?,
            ),
            None => None,
        };
        let expert = match expert {
            Some(e) => Some(if let Some(i) = e.strip_prefix("le").and_then(index) {
                Expert::Local(i)
            } else if let Some(j) = e.strip_prefix('e').and_then(index) {
                Expert::Global(j)
            } else {
                return Err(bad("the expert is not `e<index>` or `le<index>`"));
            }),
            None => None,
        };
        if layer.is_some() != role.in_layer() {
            return Err(bad(if role.in_layer() {
                "a layer's role without its layer"
            } else {
                "a role of the model's ends inside a layer"
            }));
        }
        if expert.is_some() && !role.is_expert() {
            return Err(bad("an expert index on a role that is not an expert's"));
        }
        Ok(ParamName {
            layer,
            expert,
            role,
        })
    }
}

impl Serialize for ParamName {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ParamName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<ParamName, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A rank's coordinate on each mesh axis (tp fastest, pp slowest).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct Coord {
    pub tp: u32,
    pub cp: u32,
    pub ep: u32,
    pub dp: u32,
    pub pp: u32,
}

impl Coord {
    /// `[tp, cp, ep, dp, pp]`.
    pub fn as_array(self) -> [u32; 5] {
        [self.tp, self.cp, self.ep, self.dp, self.pp]
    }
    pub fn from_array(a: [u32; 5]) -> Coord {
        Coord {
            tp: a[0],
            cp: a[1],
            ep: a[2],
            dp: a[3],
            pp: a[4],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_unknown_is_an_error() {
        let names: Vec<&str> = Axis::ALL.iter().map(|a| a.name()).collect();
        assert_eq!(
            names,
            [
                "tp",
                "cp",
                "ep",
                "dp",
                "pp",
                "dense_dp",
                "expert_dp",
                "world"
            ]
        );
        for a in Axis::ALL {
            assert_eq!(a.name().parse::<Axis>(), Ok(a));
        }
        let e = "tensor".parse::<Axis>().unwrap_err();
        assert!(e.contains("unknown axis \"tensor\""), "{e}");
        assert_eq!(
            serde_json::to_string(&Axis::DenseDp).unwrap(),
            "\"dense_dp\""
        );
    }

    #[test]
    fn roles_parse_back_and_unknown_is_an_error() {
        for r in Role::ALL {
            assert_eq!(r.name().parse::<Role>(), Ok(r));
            assert_eq!(r.to_string(), r.name());
            assert_eq!(
                serde_json::to_string(&r).unwrap(),
                format!("\"{}\"", r.name())
            );
        }
        let mut names: Vec<&str> = Role::ALL.iter().map(|r| r.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Role::ALL.len(), "role names are distinct");
        let e = "qkv_proj".parse::<Role>().unwrap_err();
        assert!(e.contains("unknown parameter role \"qkv_proj\""), "{e}");
        assert!(e.contains("expert_fc1") && e.contains("lm_head"), "{e}");
        for g in GemmRole::ALL {
            assert_eq!(g.name().parse::<GemmRole>(), Ok(g));
            for p in GemmPass::ALL {
                let n = GemmName::new(g, p);
                assert_eq!(n.to_string().parse::<GemmName>(), Ok(n));
                let json = serde_json::to_string(&n).unwrap();
                assert_eq!(json, format!("\"{n}\""));
                assert_eq!(serde_json::from_str::<GemmName>(&json).unwrap(), n);
            }
            assert!(GemmRole::of(g.weight()).is_some());
            assert_eq!(GemmRole::of(g.weight()) == Some(g), !g.is_partial());
        }
        for bad in ["attn", "qkv.xgrad", "norm.dgrad", ".dgrad", ""] {
            let e = bad.parse::<GemmName>().unwrap_err();
            assert!(e.contains("unknown gemm role"), "{bad}: {e}");
        }
        assert_eq!(
            "k_proj.wgrad".parse::<GemmName>(),
            Ok(GemmName::new(GemmRole::KProj, GemmPass::Wgrad))
        );
        assert!(serde_json::from_str::<GemmName>("\"fc3\"").is_err());
    }

    #[test]
    fn role_facts() {
        let split = |s| {
            Role::ALL
                .into_iter()
                .filter(|r| r.tp_split() == s)
                .map(Role::name)
                .collect::<Vec<_>>()
        };
        assert_eq!(
            split(TpSplit::Rows),
            ["embedding", "proj", "fc2", "expert_fc2", "shared_fc2"]
        );
        assert_eq!(
            split(TpSplit::Cols),
            ["qkv", "fc1", "expert_fc1", "shared_fc1", "lm_head"]
        );
        let vectors: Vec<&str> = Role::ALL
            .into_iter()
            .filter(|r| r.is_vector())
            .map(Role::name)
            .collect();
        assert_eq!(
            vectors,
            [
                "attn_norm",
                "attn_norm_bias",
                "mlp_norm",
                "mlp_norm_bias",
                "final_norm",
                "final_norm_bias"
            ]
        );
        for r in Role::ALL {
            if let Some(b) = r.norm_bias() {
                assert!(r.is_norm() && b.is_bias() && b.in_layer() == r.in_layer());
                assert_eq!(b.name(), format!("{}_bias", r.name()));
            }
            assert_eq!(r.is_norm(), r.norm_bias().is_some());
            assert_eq!(r.is_expert(), r.name().starts_with("expert_"));
        }
    }

    #[test]
    fn param_names_parse_back() {
        let cases = [
            ("embedding", ParamName::ends(Role::Embedding)),
            ("L3.qkv", ParamName::layer(3, Role::Qkv)),
            ("L12.expert_fc1", ParamName::layer(12, Role::ExpertFc1)),
            (
                "L3.e5.expert_fc2",
                ParamName::expert(3, Expert::Global(5), Role::ExpertFc2),
            ),
            (
                "L0.le1.expert_fc1",
                ParamName::expert(0, Expert::Local(1), Role::ExpertFc1),
            ),
        ];
        for (s, p) in cases {
            assert_eq!(s.parse::<ParamName>(), Ok(p), "{s}");
            assert_eq!(p.to_string(), s);
            assert_eq!(serde_json::to_string(&p).unwrap(), format!("\"{s}\""));
        }
        for r in Role::ALL {
            let p = if r.in_layer() {
                ParamName::layer(7, r)
            } else {
                ParamName::ends(r)
            };
            assert_eq!(p.to_string().parse::<ParamName>(), Ok(p));
        }
        for (bad, why) in [
            ("L3.qkv_w", "unknown parameter role \"qkv_w\""),
            ("qkv", "without its layer"),
            ("L3.embedding", "ends inside a layer"),
            ("L3.e1.qkv", "not an expert's"),
            ("L03.qkv", "`L<index>`"),
            ("X3.qkv", "`L<index>`"),
            ("L3.x1.expert_fc1", "`e<index>`"),
            ("L3.e1.e2.expert_fc1", "not `role`"),
            ("", "unknown parameter role"),
        ] {
            let e = bad.parse::<ParamName>().unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
            assert!(e.contains(&format!("{bad:?}")), "{bad}: {e}");
        }
    }
}
