//! Typed u32 ids whose text form is their readable name: `n12` (node), `g3` (process
//! group), `b5` (buffer), `%7` (value).

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

macro_rules! id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(
            Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
        )]
        #[serde(transparent)]
        pub struct $name(pub u32);

        impl $name {
            pub const PREFIX: &'static str = $prefix;
            pub fn index(self) -> usize {
                self.0 as usize
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }

        impl FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                s.strip_prefix($prefix)
                    .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
                    .and_then(|d| d.parse().ok())
                    .map($name)
                    .ok_or_else(|| format!("`{s}` is not a {} id (`{}N`)", stringify!($name), $prefix))
            }
        }
    };
}

id!(
    /// A node of a rank's graph: its index in program order.
    NodeId,
    "n"
);
id!(
    /// A process group, unique across the whole program.
    GroupId,
    "g"
);
id!(
    /// A named buffer of a rank's graph.
    BufferId,
    "b"
);
id!(
    /// A value (tensor) of a rank's graph: parameters, gradients, optimizer state, data
    /// and activations.
    ValueId,
    "%"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_print_and_parse() {
        assert_eq!(NodeId(12).to_string(), "n12");
        assert_eq!("g3".parse::<GroupId>().unwrap(), GroupId(3));
        assert!("n".parse::<NodeId>().is_err());
        assert!("g3".parse::<NodeId>().is_err());
        assert!("b-1".parse::<BufferId>().is_err());
        assert!("b99999999999".parse::<BufferId>().is_err());
    }
}
