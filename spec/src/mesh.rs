//! Interim mesh (replaced by the groundwork branch's module on merge).
use crate::layout::Layout;
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Coord {
    pub tp: u32,
    pub cp: u32,
    pub ep: u32,
    pub dp: u32,
    pub pp: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GroupKind {
    Tp,
    Cp,
    Ep,
    Dp,
    Pp,
    DenseDp,
    ExpertDp,
}

impl GroupKind {
    pub fn name(self) -> &'static str {
        match self {
            GroupKind::Tp => "tp",
            GroupKind::Cp => "cp",
            GroupKind::Ep => "ep",
            GroupKind::Dp => "dp",
            GroupKind::Pp => "pp",
            GroupKind::DenseDp => "dense_dp",
            GroupKind::ExpertDp => "expert_dp",
        }
    }
}
impl fmt::Display for GroupKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupShape {
    pub dims: Vec<(u64, u64)>,
}
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fabric {
    pub crosses_nodes: bool,
    pub ranks_per_node: u64,
    pub nodes: u64,
}

#[derive(Clone, Debug)]
pub struct Mesh {
    d: [u32; 5],
    gpn: u32,
}

impl Mesh {
    pub fn new(l: &Layout, gpus_per_node: u32) -> Mesh {
        Mesh {
            d: [l.tp, l.cp, l.ep, l.dp, l.pp],
            gpn: gpus_per_node,
        }
    }
    pub fn world(&self) -> u32 {
        self.d.iter().product()
    }
    fn stride(&self, axis: usize) -> u32 {
        self.d[..axis].iter().product()
    }
    pub fn coord(&self, r: u32) -> Coord {
        let c: Vec<u32> = (0..5).map(|a| (r / self.stride(a)) % self.d[a]).collect();
        Coord {
            tp: c[0],
            cp: c[1],
            ep: c[2],
            dp: c[3],
            pp: c[4],
        }
    }
    pub fn rank(&self, c: Coord) -> u32 {
        [c.tp, c.cp, c.ep, c.dp, c.pp]
            .iter()
            .enumerate()
            .map(|(a, x)| x * self.stride(a))
            .sum()
    }
    fn axes(k: GroupKind) -> &'static [usize] {
        match k {
            GroupKind::Tp => &[0],
            GroupKind::Cp => &[1],
            GroupKind::Ep => &[2],
            GroupKind::Dp => &[3],
            GroupKind::Pp => &[4],
            GroupKind::DenseDp => &[1, 2, 3],
            GroupKind::ExpertDp => &[1, 3],
        }
    }
    pub fn size(&self, k: GroupKind) -> u32 {
        Self::axes(k).iter().map(|&a| self.d[a]).product()
    }
    pub fn shape(&self, k: GroupKind) -> GroupShape {
        GroupShape {
            dims: Self::axes(k)
                .iter()
                .map(|&a| (self.stride(a) as u64, self.d[a] as u64))
                .collect(),
        }
    }
    pub fn members(&self, k: GroupKind, r: u32) -> Vec<u32> {
        let mut base = r;
        for &a in Self::axes(k) {
            base -= ((r / self.stride(a)) % self.d[a]) * self.stride(a);
        }
        let mut out = vec![base];
        for &a in Self::axes(k) {
            let mut next = Vec::new();
            for i in 0..self.d[a] {
                for &x in &out {
                    next.push(x + i * self.stride(a));
                }
            }
            out = next;
        }
        out.sort_unstable();
        out
    }
    pub fn fabric(&self, k: GroupKind) -> Fabric {
        let m = self.members(k, 0);
        let nodes: std::collections::BTreeSet<u32> = m.iter().map(|r| r / self.gpn).collect();
        Fabric {
            crosses_nodes: nodes.len() > 1,
            ranks_per_node: (m.len() / nodes.len()) as u64,
            nodes: nodes.len() as u64,
        }
    }
    pub fn num_groups(&self, k: GroupKind) -> u32 {
        self.world() / self.size(k)
    }
    pub fn group_index(&self, k: GroupKind, r: u32) -> u32 {
        let mut idx = 0;
        let mut mult = 1;
        for a in 0..5 {
            if Self::axes(k).contains(&a) {
                continue;
            }
            idx += ((r / self.stride(a)) % self.d[a]) * mult;
            mult *= self.d[a];
        }
        idx
    }
    pub fn index_in_group(&self, k: GroupKind, r: u32) -> u32 {
        self.members(k, r).iter().position(|&x| x == r).unwrap() as u32
    }
}
