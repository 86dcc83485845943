//! The client APIs a node serves, as siblings, one file each: OpenAI chat completions
//! (`openai`), Anthropic Messages (`anthropic`), OpenAI Responses (`responses`), embeddings
//! (`embeddings`). Each decodes its request into what the pipeline reads and writes the decided
//! answer (whole, or as its stream's events) and its errors in its own envelope. Nothing here
//! uses an upstream API's module: both sides meet in `node::exchange`.

pub mod anthropic;
pub mod embeddings;
pub mod openai;
pub mod responses;
