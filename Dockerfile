# syntax=docker/dockerfile:1
# Container image for collab-projector: `docker build -t collab-projector .`
# (docker-compose.yml builds it too). Keep `target/` out of the build context with .dockerignore.

# --- build ---------------------------------------------------------------------------------------
FROM rust:1-bookworm AS builder
WORKDIR /src
COPY . .
# Cache mounts keep the crate registry and compiled dependencies between builds; the target dir is a
# cache, not a layer, so the binary is copied out of it in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked \
    && install -D -m 0755 target/release/collab-projector /out/collab-projector

# --- run -----------------------------------------------------------------------------------------
FROM debian:bookworm-slim
# ca-certificates: for TLS connections to NATS (tls:// URLs).
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
# A fixed, unprivileged uid, so volume permissions and Kubernetes runAsNonRoot checks are predictable.
RUN groupadd --system --gid 10001 collab \
    && useradd --system --uid 10001 --gid collab --no-create-home --shell /usr/sbin/nologin collab
COPY --from=builder /out/collab-projector /usr/local/bin/collab-projector
COPY config/default.toml config/compose.toml /etc/collab-projector/
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["collab-projector"]
CMD ["run", "--config", "/etc/collab-projector/default.toml"]
