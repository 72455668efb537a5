# idemscrape — the two commands a newcomer needs are `make demo` and `make test`.
SHELL     := /bin/bash
GO        ?= go
PKGS      ?= ./...
BENCHTIME ?= 2s
GOLANGCI_VERSION := v2.15.0
GOLANGCI  := $(shell $(GO) env GOPATH)/bin/golangci-lint

.PHONY: soak test-deps test check lint lint-deps vet fmt demo bench bench-compare chaos chaos-short fuzz services tidy surface

## test: services (and the test browser) up, vet, then every test with the race detector
## against real Redis and PostgreSQL; per-package times at the end, slowest first.
test: test-deps vet
	@log=$$(mktemp); set -o pipefail; \
	$(GO) test -race -count=1 -timeout 20m $(PKGS) 2>&1 | tee $$log; st=$$?; \
	echo; echo "per-package times, slowest first (load $$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)):"; \
	awk '($$1 == "ok" || $$1 == "FAIL") && $$3 ~ /^[0-9.]+s$$/ { printf "%10s  %-4s %s\n", $$3, $$1, $$2 }' $$log | sort -rn; \
	rm -f $$log; exit $$st

## vet: go vet.
vet:
	$(GO) vet $(PKGS)

## check: gofmt (fails on unformatted files), go vet, golangci-lint, go mod tidy drift.
check: vet lint
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	@cp go.mod /tmp/idemscrape.go.mod.$$$$ && cp go.sum /tmp/idemscrape.go.sum.$$$$ && $(GO) mod tidy && \
	  if ! cmp -s go.mod /tmp/idemscrape.go.mod.$$$$ || ! cmp -s go.sum /tmp/idemscrape.go.sum.$$$$; then \
	    echo "go mod tidy changed go.mod/go.sum: commit the result"; exit 1; fi

## lint: golangci-lint with the committed .golangci.yml (each disabled check says why).
lint: lint-deps
	$(GOLANGCI) run --timeout 10m $(PKGS)

## lint-deps: golangci-lint $(GOLANGCI_VERSION) in GOPATH/bin, installed when missing or another version.
lint-deps:
	@$(GOLANGCI) version 2>/dev/null | grep -q "version $(patsubst v%,%,$(GOLANGCI_VERSION)) " || \
	  { echo "installing golangci-lint $(GOLANGCI_VERSION)"; $(GO) install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$(GOLANGCI_VERSION); }

## demo: start the services (and install Debian's chromium for the JavaScript phase) if
## needed, then run the demo: a fake shop and a fake residential proxy with faults, the
## worker service with its dispatcher, a scheduler tick, a consumer; a summary; exit 1 if an
## invariant breaks. UI=1 keeps asynqmon and the job pages up.
UI ?=
demo: test-deps
	IDEMSCRAPE_DEMO_UI=$(UI) $(GO) run ./cmd/demo $(if $(KEEP),-keep)

## surface: the exported identifiers of the library packages (docs/PACKAGES.md, "API surface").
surface:
	$(GO) run ./internal/surface

## bench: every benchmark, with memory statistics.
bench: services
	$(GO) test -run '^$$' -bench . -benchmem -benchtime $(BENCHTIME) $(PKGS)

## bench-compare: idemscrape vs hand-written asynq + colly and River + colly peers, run
## alternately, each run in its own process with its own database and redis-server; prints
## medians, ratios, spread and whole-box CPU per job. Other flags: BENCHCOMPARE_FLAGS, e.g.
## BENCHCOMPARE_FLAGS='-site-delay 300ms -concurrency 200 -pg-conns 40 -modes b1,river,riverfast -n 4000'
## (residential latency; see cmd/benchcompare/README.md).
BENCHCOMPARE_FLAGS ?= -n 2000 -pairs 5
bench-compare: services
	$(GO) run ./cmd/benchcompare $(BENCHCOMPARE_FLAGS)

## chaos: the full chaos run over the real worker and reconciler binaries (10,000 jobs, every
## fault; see docs/RELIABILITY.md). chaos-short: the CI mix (under 5 minutes on 2 cores).
chaos: services
	$(GO) run ./cmd/chaos
chaos-short: services
	$(GO) run ./cmd/chaos -short

## soak: a simulated season (internal/soak): 100 days of 1,000 jobs, job retention 30 days,
## each day a PostgreSQL blip at tick time, a Redis restart (one day in five with its data
## lost), a dead consumer group; prints the tables and Redis by day (docs/RELIABILITY.md).
## make test runs a 20-day season of 50 jobs a day with the same checks.
soak: services
	IDEMSCRAPE_SOAK=full $(GO) test -count=1 -run '^TestSoak$$' -v -timeout 30m ./internal/soak/

## fuzz: URL normalisation fuzzing for FUZZTIME (default 60s).
FUZZTIME ?= 60s
fuzz:
	$(GO) test ./tasks -run '^$$' -fuzz FuzzNormalize -fuzztime $(FUZZTIME)

## test-deps: services, Debian's chromium (browser tests) and promtool (alert rule tests) when missing.
test-deps:
	./.ci/run --test-deps

## services: make sure Redis and PostgreSQL answer on loopback, starting them if they are down.
services:
	./.ci/run --services-only
