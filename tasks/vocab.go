package tasks

// The job vocabulary lives in package job, which imports no asynq, go-redis or
// OpenTelemetry (parse and kinds need it without the queue). These names keep tasks' API
// whole for the code that enqueues; each is package job's.

import (
	"net/netip"

	"github.com/idemscrape/idemscrape/job"
)

// Types of package job.
type (
	Category          = job.Category
	DestinationPolicy = job.DestinationPolicy
	Failure           = job.Failure
	FieldError        = job.FieldError
	Normalizer        = job.Normalizer
	NormalizerOption  = job.NormalizerOption
	Payload           = job.Payload
	Spec              = job.Spec
)

// Variables of package job (the same values).
var (
	DefaultDestinationPorts = job.DefaultDestinationPorts
	DefaultNormalizer       = job.DefaultNormalizer
	ErrInvalidSpec          = job.ErrInvalidSpec
)

// Constants of package job.
const (
	CategoryBlocked              = job.CategoryBlocked
	CategoryBodyTooLarge         = job.CategoryBodyTooLarge
	CategoryBudgetExceeded       = job.CategoryBudgetExceeded
	CategoryDNSNotFound          = job.CategoryDNSNotFound
	CategoryDestinationError     = job.CategoryDestinationError
	CategoryExitUnavailable      = job.CategoryExitUnavailable
	CategoryForbiddenAddress     = job.CategoryForbiddenAddress
	CategoryInternal             = job.CategoryInternal
	CategoryInterrupted          = job.CategoryInterrupted
	CategoryLeaseBusy            = job.CategoryLeaseBusy
	CategoryLeaseLost            = job.CategoryLeaseLost
	CategoryNetwork              = job.CategoryNetwork
	CategoryNotFound             = job.CategoryNotFound
	CategoryPanic                = job.CategoryPanic
	CategoryParseError           = job.CategoryParseError
	CategoryProxyAuth            = job.CategoryProxyAuth
	CategoryRobotsDisallowed     = job.CategoryRobotsDisallowed
	CategorySessionLost          = job.CategorySessionLost
	CategorySuperseded           = job.CategorySuperseded
	CategoryThrottled            = job.CategoryThrottled
	CategoryTimeout              = job.CategoryTimeout
	CategoryUnsafeStepIncomplete = job.CategoryUnsafeStepIncomplete
	CategoryValidation           = job.CategoryValidation
	DefaultPayloadVersion        = job.DefaultPayloadVersion
	MaxQueueLen                  = job.MaxQueueLen
	PayloadV1                    = job.PayloadV1
	PayloadV2                    = job.PayloadV2
)

// CategoryFrom is job.CategoryFrom.
func CategoryFrom(err error) (job.Category, bool) { return job.CategoryFrom(err) }

// CheckQueue is job.CheckQueue.
func CheckQueue(name string) error { return job.CheckQueue(name) }

// DecodePayload is job.DecodePayload.
func DecodePayload(b []byte, n *job.Normalizer) (job.Payload, error) { return job.DecodePayload(b, n) }

// EmbeddedAddr is job.EmbeddedAddr.
func EmbeddedAddr(addr netip.Addr) netip.Addr { return job.EmbeddedAddr(addr) }

// EncodePayload is job.EncodePayload.
func EncodePayload(p job.Payload, version int) ([]byte, error) { return job.EncodePayload(p, version) }

// Fail is job.Fail.
func Fail(c job.Category, err error) error { return job.Fail(c, err) }

// LoopbackPolicy is job.LoopbackPolicy.
func LoopbackPolicy() *job.DestinationPolicy { return job.LoopbackPolicy() }

// NewNormalizer is job.NewNormalizer.
func NewNormalizer(opts ...job.NormalizerOption) *job.Normalizer { return job.NewNormalizer(opts...) }

// StrictDestinationPolicy is job.StrictDestinationPolicy.
func StrictDestinationPolicy() *job.DestinationPolicy { return job.StrictDestinationPolicy() }

// WithTrackingParams is job.WithTrackingParams.
func WithTrackingParams(names ...string) job.NormalizerOption {
	return job.WithTrackingParams(names...)
}

// WithTrackingPrefixes is job.WithTrackingPrefixes.
func WithTrackingPrefixes(prefixes ...string) job.NormalizerOption {
	return job.WithTrackingPrefixes(prefixes...)
}

// WithoutDefaultTrackingParams is job.WithoutDefaultTrackingParams.
func WithoutDefaultTrackingParams() job.NormalizerOption { return job.WithoutDefaultTrackingParams() }
