# kvrouter: one binary (serve, frontend, bridge, mocker, ...) in a small non-root image.
#   docker build -t kvrouter:0.1.0 .
#   docker run --rm kvrouter:0.1.0 serve --help
# Kubernetes manifests that use it: deploy/kubernetes (README.md, "Deploying").

# The operator's set only: no benchmark or chaos commands (--no-default-features leaves out
# the bench feature; docs/architecture.md, "The binary and its features").
# The builder and the runtime share Debian 12 (bookworm), so the binary's glibc matches.
ARG RUST_VERSION=1.95
FROM rust:${RUST_VERSION}-slim-bookworm AS builder
WORKDIR /src
COPY . .
# BuildKit cache mounts keep the registry and the build between builds; the binary is copied
# out of the cached target directory.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --no-default-features --bin kvrouter \
    && install -m 0755 target/release/kvrouter /usr/local/bin/kvrouter

# glibc, libgcc and CA certificates, no shell; runs as uid 65532.
FROM gcr.io/distroless/cc-debian12:nonroot AS runtime
COPY --from=builder /usr/local/bin/kvrouter /usr/local/bin/kvrouter
USER 65532:65532
# frontend (--listen), serve admin (--admin-addr) and JSON API (--http-addr), bridge admin.
EXPOSE 8000 9090 8080 9100
ENTRYPOINT ["kvrouter"]
CMD ["--help"]
