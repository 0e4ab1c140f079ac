# Multi-stage build: compile in the Rust image, run on a slim Debian as a non-root user.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
RUN cargo build --release --locked --bin seedlock

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home seedlock
COPY --from=build /src/target/release/seedlock /usr/local/bin/seedlock
USER seedlock
ENTRYPOINT ["seedlock"]
