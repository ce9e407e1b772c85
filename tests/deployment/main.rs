//! The deployment as shipped: the Kubernetes manifests (rendered, validated, and their
//! configuration run for real), NATS permissions and credentials.

#[path = "../common/mod.rs"]
mod common;

mod image;
mod k8s_gateway;
mod k8s_locked;
mod k8s_manifests;
mod nats_creds;
mod nats_permissions;
mod nats_url_credentials;
