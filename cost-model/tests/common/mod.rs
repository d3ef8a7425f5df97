//! Helpers shared by the cost model's integration tests.

use shardwright_cost::{resolve, ResolveOptions};
use shardwright_spec::parse::{parse_spec, Format};
use shardwright_spec::Job;

/// The resolved job of a YAML spec.
pub fn job(yaml: &str) -> Job {
    let spec = parse_spec(yaml, Format::Yaml).unwrap();
    resolve(&spec, &ResolveOptions::default()).unwrap().job
}

/// The error resolving a YAML spec gives (it must give one).
#[allow(dead_code)]
pub fn spec_error(yaml: &str) -> String {
    let spec = parse_spec(yaml, Format::Yaml).unwrap();
    match resolve(&spec, &ResolveOptions::default()) {
        Ok(_) => panic!("spec resolved, expected an error"),
        Err(e) => e.to_string(),
    }
}
