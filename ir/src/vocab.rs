//! The project's shared vocabulary: mesh axes as one enum, and a rank's coordinates on
//! them.
//!
//! Every crate that names a process group's axis (the mesh in `spec`, the cost model, the
//! lowering, the executor) uses [`Axis`]; the text form prints [`Axis::name`] and parsing
//! an unknown name is an error, never a default.

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

impl fmt::Display for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Axis {
    type Err = String;
    fn from_str(s: &str) -> Result<Axis, String> {
        Axis::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Axis::ALL.iter().map(|a| a.name()).collect();
                format!("unknown axis {s:?} (one of {})", names.join(", "))
            })
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
}
