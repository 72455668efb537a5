package scheduler_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemscrape/idemscrape/scheduler"
)

const validConfig = `
templates:
  - name: catalog-daily
    cron: "0 6 * * *"
    timezone: America/New_York
    window: daily
    kind: catalog
    sources:
      ids: [sku-1, sku-2]
      urls: ["https://shop.example.com/p/1"]
    countries: [US, de]
    parser_version: 3
    scope: acme
  - name: other
    cron: "CRON_TZ=Asia/Kolkata 30 * * * *"
    window: hourly
    kind: catalog
    sources: {ids: [sku-3]}
    countries: [IN]
    parser_version: 1
    catchup: none
kinds:
  catalog: {queue: catalog-q, max_lease: 10m}
reconciler:
  interval: 1m
`

func TestTemplateValidation(t *testing.T) {
	dir := t.TempDir()
	sources := filepath.Join(dir, "skus.txt")
	require.NoError(t, os.WriteFile(sources, []byte("# comment\nsku-a\n\nhttps://shop.example.com/p/9\n"), 0o600))

	t.Run("ValidConfigAndDefaults", func(t *testing.T) {
		f, err := scheduler.ParseFile([]byte(validConfig), dir, nil)
		require.NoError(t, err)
		require.Len(t, f.Templates, 2)
		assert.Equal(t, scheduler.CatchUpLast, f.Templates[0].CatchUp)
		assert.Equal(t, "Asia/Kolkata", f.Templates[1].Timezone)
		assert.Equal(t, "catalog-q", f.QueueFor("catalog"))
		assert.Equal(t, "books", f.QueueFor("books"), "queue defaults to the kind's name")
		assert.Equal(t, 10*time.Minute, f.MaxLeaseFor("catalog"))
		assert.Equal(t, scheduler.DefaultMaxLease, f.MaxLeaseFor("books"))
		assert.Equal(t, time.Minute, f.Reconciler.Interval)
		assert.Equal(t, scheduler.DefaultBatchSize, f.Reconciler.BatchSize)
		assert.Equal(t, scheduler.DefaultSavedInputRetention, f.Reconciler.SavedInputRetention)
	})

	t.Run("SourceFileRelativeToConfig", func(t *testing.T) {
		cfg := strings.Replace(validConfig, "ids: [sku-3]", "file: skus.txt", 1)
		_, err := scheduler.ParseFile([]byte(cfg), dir, nil)
		require.NoError(t, err)
	})

	// Each case replaces old with new in validConfig (or appends) and must fail naming the
	// section (template) and the field.
	cases := []struct {
		name, old, new   string
		section, field   string
		reasonSubstrings string
	}{
		{"BadCron", `"0 6 * * *"`, `"61 6 * * *"`, `template "catalog-daily"`, "cron", "end of range"},
		{"CronTooManyFields", `"0 6 * * *"`, `"0 0 6 * * * *"`, `template "catalog-daily"`, "cron", "expected"},
		{"EmptyCron", `cron: "0 6 * * *"`, `cron: ""`, `template "catalog-daily"`, "cron", "required"},
		{"EveryDescriptorRefused", `"0 6 * * *"`, `"@every 1h"`, `template "catalog-daily"`, "cron", "@every"},
		{"CronTZWithoutExpression", `"CRON_TZ=Asia/Kolkata 30 * * * *"`, `"CRON_TZ=Asia/Kolkata"`, `template "other"`, "cron", "followed by"},
		{"UnknownZone", `America/New_York`, `Mars/Olympus_Mons`, `template "catalog-daily"`, "timezone", "unknown time zone"},
		{"UnknownCronTZ", `CRON_TZ=Asia/Kolkata`, `CRON_TZ=Asia/Nowhere`, `template "other"`, "timezone", "unknown time zone"},
		{"ZoneDisagreesWithCronTZ", "window: hourly", "window: hourly\n    timezone: UTC", `template "other"`, "timezone", "disagrees"},
		{"KindNameForm", "kind: catalog\n    sources:\n      ids: [sku-1", "kind: Catalog\n    sources:\n      ids: [sku-1", `template "catalog-daily"`, "kind", "lower-case"},
		{"KindMissing", "kind: catalog\n    sources: {ids", "sources: {ids", `template "other"`, "kind", "required"},
		{"EmptySources", "sources: {ids: [sku-3]}", "sources: {ids: []}", `template "other"`, "sources", "at least one"},
		{"MissingSourceFile", "ids: [sku-3]", "file: nope.txt", `template "other"`, "sources.file", "no such file"},
		{"BadSourceURL", `"https://shop.example.com/p/1"`, `"ftp://shop.example.com/p/1"`, `template "catalog-daily"`, "sources.urls[0]", "http"},
		{"BadSourceID", "ids: [sku-1, sku-2]", `ids: [sku-1, " sku-2"]`, `template "catalog-daily"`, "sources.ids[1]", "space"},
		{"UnknownCountry", "countries: [US, de]", "countries: [US, XX]", `template "catalog-daily"`, "countries[1]", ""},
		{"NoCountries", "countries: [IN]", "countries: []", `template "other"`, "countries", "at least one"},
		{"ParserVersionZero", "parser_version: 3", "parser_version: 0", `template "catalog-daily"`, "parser_version", ">= 1"},
		{"BadScope", "scope: acme", "scope: a/b", `template "catalog-daily"`, "scope", "not allowed"},
		{"UnknownWindowRule", "window: daily", "window: fortnightly", `template "catalog-daily"`, "window", "not a window rule"},
		{"BadCatchUp", "catchup: none", "catchup: all", `template "other"`, "catchup", "want"},
		{"DuplicateNames", "name: other", "name: catalog-daily", `template "catalog-daily"`, "name", "duplicate"},
		{"MissingName", "- name: other\n    cron", "- cron", "templates[1]", "name", "required"},
		{"BadName", "name: other", "name: other template", "templates[1]", "name", "want"},
		{"UnknownField", "parser_version: 1\n", "parser_version: 1\n    retries: 3\n", `template "other"`, "retries", "unknown field"},
		{"UnknownNestedField", "sources: {ids: [sku-3]}", "sources: {ids: [sku-3], glob: '*.txt'}", `template "other"`, "sources.glob", "unknown field"},
		{"UnknownKindField", "max_lease: 10m}", "max_lease: 10m, priority: 3}", `kinds "catalog"`, "priority", "unknown field"},
		{"BadKindQueue", "queue: catalog-q", "queue: 'catalog q'", `kinds "catalog"`, "queue", "want"},
		{"NegativeMaxLease", "max_lease: 10m", "max_lease: -1m", `kinds "catalog"`, "max_lease", "negative"},
		{"ReconcilerBatch", "interval: 1m", "interval: 1m\n  batch_size: -5", "reconciler", "batch_size", "out of range"},
		{"ReconcilerUnknownField", "interval: 1m", "interval: 1m\n  every: 5m", "reconciler", "every", "unknown field"},
		{"SavedInputRetentionTooShort", "interval: 1m", "interval: 1m\n  saved_input_retention: 90m", "reconciler", "saved_input_retention", "below the minimum 2h0m0s"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			require.Contains(t, validConfig, tc.old, "test case does not apply")
			cfg := strings.Replace(validConfig, tc.old, tc.new, 1)
			f, err := scheduler.ParseFile([]byte(cfg), dir, nil)
			require.Error(t, err)
			assert.Nil(t, f, "no configuration, so no scheduler, on error")
			var ce *scheduler.ConfigError
			require.True(t, errors.As(err, &ce), "want *ConfigError, got %T: %v", err, err)
			assert.ErrorIs(t, err, scheduler.ErrInvalidConfig)
			assert.Equal(t, tc.section, ce.Section, err.Error())
			assert.Equal(t, tc.field, ce.Field, err.Error())
			assert.Contains(t, err.Error(), tc.reasonSubstrings)
		})
	}

	t.Run("YAMLSyntax", func(t *testing.T) {
		_, err := scheduler.ParseFile([]byte("templates: [\n"), dir, nil)
		var ce *scheduler.ConfigError
		require.ErrorAs(t, err, &ce)
		assert.Equal(t, "file", ce.Section)
	})
	t.Run("UnknownTopLevelField", func(t *testing.T) {
		_, err := scheduler.ParseFile([]byte(validConfig+"workers: 3\n"), dir, nil)
		var ce *scheduler.ConfigError
		require.ErrorAs(t, err, &ce)
		assert.Equal(t, "workers", ce.Field)
	})
}

func TestExampleConfig(t *testing.T) {
	f, err := scheduler.LoadFile("../examples/scheduler.yaml")
	require.NoError(t, err)
	require.Len(t, f.Templates, 2)
	assert.Equal(t, "catalog", f.QueueFor("catalog"))
	assert.Equal(t, 30*time.Minute, f.MaxLeaseFor("catalog"))
	defaults := &scheduler.File{}
	require.NoError(t, defaults.Validate(nil))
	assert.Equal(t, defaults.Reconciler, f.Reconciler, "the example shows the defaults")

	berlin, err := time.LoadLocation("Europe/Berlin")
	require.NoError(t, err)
	for at, want := range map[string]string{
		"2026-10-25T00:05:00Z": "2026-10-25T02+02:00", // as the example's comment says
		"2026-10-25T01:05:00Z": "2026-10-25T02+01:00",
	} {
		ts, err := time.Parse(time.RFC3339, at)
		require.NoError(t, err)
		got, err := scheduler.Hourly.Window(ts, berlin)
		require.NoError(t, err)
		assert.Equal(t, want, got)
	}
}
