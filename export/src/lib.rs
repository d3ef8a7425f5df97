//! shardwright-export: a plan in the words of the engine that runs it, and back.
//!
//! - [`export`]: a [`Plan`] -> Megatron-LM launch flags, NeMo 2 / Megatron-Bridge recipe
//!   overrides, a torchtitan config (0.3.x: a Python config function; 0.2.x: TOML), a
//!   DeepSpeed JSON config (minijinja templates under
//!   `export/templates/`, embedded, overridable with a user's own file).
//! - [`import`]: a user's Megatron flags / torchtitan TOML / DeepSpeed JSON -> the layout
//!   pins of a job spec (merged into a spec that holds the cluster).
//! - [`launch`]: a Slurm batch script that runs `shardwright execute PLAN` with the plan's
//!   rank placement (rendering only: nothing is submitted).
//!
//! Architecture invariant: a pure translation of (`Plan` or framework text) to text or
//! pins: no cost formulas, no search, no I/O. Every layout choice a framework cannot
//! express is reported (a note in the rendered file and a warning for the caller), never
//! dropped silently; [`import::project`] says exactly which part of a layout survives a
//! round trip through each framework, and the tests hold export -> import to it.

#![recursion_limit = "256"]
pub mod context;
pub mod import;
pub mod launch;
pub mod megatron;
pub mod torchtitan;

use shardwright_spec::Plan;
use std::fmt;
use std::str::FromStr;

/// The engines a plan can be exported to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Framework {
    Megatron,
    Nemo,
    Torchtitan,
    Deepspeed,
}

impl Framework {
    pub const ALL: [Framework; 4] = [
        Framework::Megatron,
        Framework::Nemo,
        Framework::Torchtitan,
        Framework::Deepspeed,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Framework::Megatron => "megatron",
            Framework::Nemo => "nemo",
            Framework::Torchtitan => "torchtitan",
            Framework::Deepspeed => "deepspeed",
        }
    }

    /// The default release's engine.
    fn default_engine(self) -> Engine {
        Engine::resolve(self, None).expect("the default engine release resolves")
    }

    /// The template file under `export/templates/` (of the default release).
    pub fn template_file(self) -> &'static str {
        self.default_engine().template_file()
    }

    /// The built-in template text (of the default release).
    pub fn default_template(self) -> &'static str {
        self.default_engine().default_template()
    }

    /// Extension of the rendered file (`sh`, `py`, `toml`, `json`) for the default release.
    pub fn extension(self) -> &'static str {
        self.default_engine().extension()
    }

    /// Which version of the framework's sources the option names were checked against
    /// (for Megatron and torchtitan: the default release; see [`Engine::targets`]).
    pub fn targets(self) -> String {
        self.default_engine().targets()
    }
}

/// The engine release an export targets (`export --engine-version`).
#[derive(Clone, Debug)]
pub enum Engine {
    /// A recorded Megatron-LM release (its flag names and `validate_args` rules).
    Megatron(megatron::Release),
    /// A recorded torchtitan release (0.2.x: TOML; 0.3.x: a Python config function).
    Torchtitan(torchtitan::Release),
    /// NeMo / Megatron-Bridge or DeepSpeed: one supported release each.
    Fixed(Framework),
}

impl Engine {
    /// The release of `fw` named `version` (None: the default one).
    pub fn resolve(fw: Framework, version: Option<&str>) -> Result<Engine, ExportError> {
        match (fw, version) {
            (Framework::Megatron, v) => Ok(Engine::Megatron(megatron::release(v)?)),
            (Framework::Torchtitan, v) => Ok(Engine::Torchtitan(torchtitan::release(v)?)),
            (fw, None) => Ok(Engine::Fixed(fw)),
            (fw, Some(v)) => Err(ExportError::Input(format!(
                "--engine-version {v}: {fw} exports target one release ({}); --engine-version selects a Megatron-LM or torchtitan release",
                Engine::Fixed(fw).targets()
            ))),
        }
    }

    /// What the export was checked against, for the file's header and messages.
    pub fn targets(&self) -> String {
        match self {
            Engine::Megatron(r) => format!(
                "{} (flag names: export/megatron/flags/{}.txt; validate_args rules: export/megatron/rules.toml; megatron/core/parallel_state.py: default order tp-cp-ep-dp-pp)",
                r.source, r.tag
            ),
            Engine::Torchtitan(r) => r.source.into(),
            Engine::Fixed(Framework::Nemo) => NEMO_TARGET.into(),
            Engine::Fixed(Framework::Deepspeed) => DEEPSPEED_TARGET.into(),
            Engine::Fixed(fw) => unreachable!("{fw} has recorded releases"),
        }
    }

    /// The framework this is a release of.
    pub fn framework(&self) -> Framework {
        match self {
            Engine::Megatron(_) => Framework::Megatron,
            Engine::Torchtitan(_) => Framework::Torchtitan,
            Engine::Fixed(fw) => *fw,
        }
    }

    /// The template file under `export/templates/`.
    pub fn template_file(&self) -> &'static str {
        match self {
            Engine::Megatron(_) => "megatron.sh.j2",
            Engine::Torchtitan(r) => match r.format {
                torchtitan::Format::Toml => "torchtitan.toml.j2",
                torchtitan::Format::Python => "torchtitan.py.j2",
            },
            Engine::Fixed(Framework::Nemo) => "nemo.sh.j2",
            Engine::Fixed(_) => "deepspeed.json.j2",
        }
    }

    /// The built-in template text.
    pub fn default_template(&self) -> &'static str {
        match self.template_file() {
            "megatron.sh.j2" => include_str!("../templates/megatron.sh.j2"),
            "torchtitan.toml.j2" => include_str!("../templates/torchtitan.toml.j2"),
            "torchtitan.py.j2" => include_str!("../templates/torchtitan.py.j2"),
            "nemo.sh.j2" => include_str!("../templates/nemo.sh.j2"),
            _ => include_str!("../templates/deepspeed.json.j2"),
        }
    }

    /// Extension of the rendered file (`sh`, `py`, `toml`, `json`).
    pub fn extension(&self) -> &'static str {
        match self.template_file() {
            "torchtitan.py.j2" => "py",
            "torchtitan.toml.j2" => "toml",
            "deepspeed.json.j2" => "json",
            _ => "sh",
        }
    }
}

pub const NEMO_TARGET: &str = "Megatron-Bridge v0.6.0 (scripts/training/run_recipe.py: --recipe FUNCTION --mode pretrain then Hydra KEY=VALUE ConfigContainer overrides; src/megatron/bridge/training/config.py: ConfigContainer sections, GPTDatasetConfig.seq_length; model fields are megatron-core TransformerConfig's, pipeline_model_parallel_layout checked in its __post_init__)";
pub const DEEPSPEED_TARGET: &str = "DeepSpeed 0.16 to 0.19 (read against v0.19.5: deepspeed/runtime/config.py DeepSpeedConfig and _batch_assertion, get_pipeline_config; deepspeed/runtime/pipe/engine.py pipeline.activation_checkpoint_interval; deepspeed/runtime/pipe/topology.py PipeModelDataParallelTopology)";

impl fmt::Display for Framework {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Framework {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Framework::ALL
            .into_iter()
            .find(|f| f.name() == s.to_ascii_lowercase())
            .ok_or_else(|| {
                format!("unknown framework `{s}`; one of megatron, nemo, torchtitan, deepspeed")
            })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// A user template that does not parse or render (names the template and the line).
    #[error("template {name}: {reason}")]
    Template { name: String, reason: String },
    /// Bad input (the message names the flag, key or token).
    #[error("{0}")]
    Input(String),
    /// A layout the target engine cannot express, or would read differently: refused
    /// rather than exported with another meaning (the message says why).
    #[error("refused: {0}")]
    Refused(String),
}

/// A rendered file and what it could not express.
#[derive(Clone, Debug, PartialEq)]
pub struct Rendered {
    pub text: String,
    /// The same notes the file carries as comments: print them on stderr.
    pub warnings: Vec<String>,
}

/// Render `template` (a name for messages, and its text) with `ctx`.
pub(crate) fn render_template(
    name: &str,
    text: &str,
    ctx: &serde_json::Value,
) -> Result<String, ExportError> {
    let mut env = minijinja::Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
    env.set_keep_trailing_newline(true);
    // Templates escape what they need themselves (`tojson` in JSON); never HTML/JSON-escape.
    env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
    let err = |e: minijinja::Error| ExportError::Template {
        name: name.to_string(),
        reason: match e.line() {
            Some(l) => format!("line {l}: {e}"),
            None => e.to_string(),
        },
    };
    env.add_template(name, text).map_err(err)?;
    env.get_template(name)
        .map_err(err)?
        .render(ctx)
        .map_err(err)
}

/// Export `plan` to `fw`'s default release, with the built-in template or `template` =
/// (name, text).
pub fn export(
    plan: &Plan,
    fw: Framework,
    template: Option<(&str, &str)>,
) -> Result<Rendered, ExportError> {
    export_for(plan, fw, None, template)
}

/// Export `plan` to release `version` of `fw` (None: the default release; for torchtitan
/// 0.3.x a Python config function, 0.2.x a TOML file). A Megatron
/// script is checked against the release's flag names and the recorded `validate_args`
/// rules: the built-in template's output must pass (else the export is refused, naming the
/// flag or rule); a user template's failures are warnings.
pub fn export_for(
    plan: &Plan,
    fw: Framework,
    version: Option<&str>,
    template: Option<(&str, &str)>,
) -> Result<Rendered, ExportError> {
    let engine = Engine::resolve(fw, version)?;
    if let Some(what) = plan.inputs.costed_only() {
        return Err(ExportError::Refused(format!(
            "{what} is costed, not exported"
        )));
    }
    // Megatron-LM's validate_args: an interleaved schedule without the overlapped sends
    // needs more than two pipeline stages ("When interleaved schedule is used and p2p
    // communication overlap is disabled, pipeline-model-parallel size should be greater
    // than 2").
    let l = &plan.layout;
    if matches!(engine, Engine::Megatron(_))
        && l.vpp > 1
        && l.pp <= 2
        && !plan.inputs.pp_comm_overlap
    {
        return Err(ExportError::Refused(format!(
            "job.pp_comm_overlap is false on an interleaved plan at pp {}: Megatron-LM needs \
             pp > 2 to interleave without overlapping the pipeline sends",
            l.pp
        )));
    }
    let (ctx, mut warnings) = context::build(plan, fw, &engine)?;
    let (name, text) = template.unwrap_or((engine.template_file(), engine.default_template()));
    let text = render_template(name, text, &ctx)?;
    if let Engine::Megatron(r) = &engine {
        let broken = megatron::check_script(&text, r);
        if !broken.is_empty() && template.is_none() {
            return Err(ExportError::Refused(format!(
                "the Megatron-LM {} script would not pass that release's argument parser: {}",
                r.tag,
                broken.join("; ")
            )));
        }
        warnings.extend(
            broken
                .into_iter()
                .map(|b| format!("template {name} for Megatron-LM {}: {b}", r.tag)),
        );
    }
    Ok(Rendered { text, warnings })
}
