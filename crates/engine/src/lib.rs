//! The engine. The single-sequence commands drive a [`ModelRunner`] through [`Session`] and
//! [`generate`]; the serving engine ([`serve`]: [`start_serving`] and its handle) runs the
//! continuous-batching loop (`serving`) on its own thread, in vLLM v1's stages: the
//! scheduling policy ([`sched`]), the runner's forward pass and token picks ([`runner`],
//! [`picker`]), the scheduler's update, and the output stage (text through [`output`]).
//! The types every module shares are in [`types`]; this file only declares the modules.

mod batch;
mod batched;
pub mod constraint;
pub mod draft;
mod eagle;
pub mod embed;
pub mod gbnf;
mod generate;
pub mod json_rules;
mod kv;
pub mod output;
mod phases;
pub mod picker;
pub mod runner;
mod runner_eagle;
pub mod sampler;
pub mod sched;
pub mod serve;
mod serving;
pub mod spec;
pub mod spec_cost;
mod spec_gen;
pub mod types;
mod workers;

pub use batched::{batched_bench, bench_prompt, BatchedResult};
pub use generate::{generate, generate_spec, prompt_split, GenOptions, Generated};
pub use picker::{Fetch, Picker};
pub use runner::{ModelRunner, RunnerOptions, Session, Want};
pub use sampler::{argmax, logprobs, Needs, Sampler, SamplerParams};
pub use serve::{start as start_serving, start_ranks as start_serving_ranks};
pub use spec_gen::Speculator;
pub use types::{EngineError, FinishReason, Result, SchedError, BLOCK_SIZE};
