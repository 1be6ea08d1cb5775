# ckpt-gym: one image for every server of a stack (`ckpt-gym serve --server NAME`) and the CLI.
#   docker build -t ckpt-gym:local .
#   docker run --rm ckpt-gym:local --help

# --- build: every workspace package compiled with its dev dependencies ----------------------------
FROM node:20-bookworm-slim AS build
WORKDIR /app
# Manifests first: the dependency layer is rebuilt only when one of them changes, not on a source change.
COPY package.json package-lock.json tsconfig.base.json ./
COPY packages/core/package.json packages/core/
COPY packages/fake-inference/package.json packages/fake-inference/
COPY packages/resources-server/package.json packages/resources-server/
COPY packages/policy-model-server/package.json packages/policy-model-server/
COPY packages/agent-server/package.json packages/agent-server/
COPY packages/environment-server/package.json packages/environment-server/
COPY packages/coordinator-cli/package.json packages/coordinator-cli/
COPY packages/testing/package.json packages/testing/
COPY e2e/package.json e2e/
RUN npm ci --no-audit --no-fund --ignore-scripts
COPY packages/ packages/
# Dependency order; each package compiles against the declarations of those before it.
RUN for p in core fake-inference resources-server policy-model-server agent-server \
      environment-server coordinator-cli; do \
      npx tsc -p "packages/$p/tsconfig.build.json" || exit 1; \
    done

# --- runtime: production dependencies and the compiled output only, as a non-root user -----------
FROM node:20-bookworm-slim AS runtime
ENV NODE_ENV=production
# The launcher's SERVER_NODE_FLAGS (a 64 MB young generation: faster commits at scale; a 128 MB
# initial old generation: a fresh process restores without full collections on the way); in the
# environment, so the workers a server with num_workers forks (re-running the same bin) get it too.
ENV NODE_OPTIONS=--max-semi-space-size=64 --initial-old-space-size=128
# The launcher's SERVER_GLIBC_TUNABLE: malloc on transparent huge pages (fewer page faults in a
# checkpoint's buffers).
ENV GLIBC_TUNABLES=glibc.malloc.hugetlb=1
WORKDIR /app
COPY package.json package-lock.json ./
COPY packages/core/package.json packages/core/
COPY packages/fake-inference/package.json packages/fake-inference/
COPY packages/resources-server/package.json packages/resources-server/
COPY packages/policy-model-server/package.json packages/policy-model-server/
COPY packages/agent-server/package.json packages/agent-server/
COPY packages/environment-server/package.json packages/environment-server/
COPY packages/coordinator-cli/package.json packages/coordinator-cli/
COPY packages/testing/package.json packages/testing/
COPY e2e/package.json e2e/
RUN npm ci --omit=dev --no-audit --no-fund --ignore-scripts && npm cache clean --force
COPY --from=build /app/packages/core/dist packages/core/dist
COPY --from=build /app/packages/fake-inference/dist packages/fake-inference/dist
COPY --from=build /app/packages/resources-server/dist packages/resources-server/dist
COPY --from=build /app/packages/policy-model-server/dist packages/policy-model-server/dist
COPY --from=build /app/packages/agent-server/dist packages/agent-server/dist
COPY --from=build /app/packages/environment-server/dist packages/environment-server/dist
COPY --from=build /app/packages/coordinator-cli/dist packages/coordinator-cli/dist
COPY examples/ examples/
RUN chmod +x packages/coordinator-cli/dist/main.js \
    && ln -s /app/packages/coordinator-cli/dist/main.js /usr/local/bin/ckpt-gym \
    && mkdir -p /data && chown node:node /data
USER node
# Checkpoints and the token capture go here (a shared volume in docker-compose.yml).
VOLUME ["/data"]
ENTRYPOINT ["ckpt-gym"]
CMD ["--help"]
