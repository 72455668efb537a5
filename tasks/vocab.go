package tasks

// The job vocabulary lives in package job, which imports no asynq, go-redis or
// OpenTelemetry (parse and kinds need it without the queue). These names keep tasks' API
// whole for the code that enqueues.

import "github.com/idemscrape/idemscrape/job"

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

// Functions and variables of package job.
var (
	CategoryFrom                 = job.CategoryFrom
	CheckQueue                   = job.CheckQueue
	DecodePayload                = job.DecodePayload
	EmbeddedAddr                 = job.EmbeddedAddr
	EncodePayload                = job.EncodePayload
	Fail                         = job.Fail
	LoopbackPolicy               = job.LoopbackPolicy
	NewNormalizer                = job.NewNormalizer
	StrictDestinationPolicy      = job.StrictDestinationPolicy
	WithTrackingParams           = job.WithTrackingParams
	WithTrackingPrefixes         = job.WithTrackingPrefixes
	WithoutDefaultTrackingParams = job.WithoutDefaultTrackingParams
	DefaultDestinationPorts      = job.DefaultDestinationPorts
	DefaultNormalizer            = job.DefaultNormalizer
	ErrInvalidSpec               = job.ErrInvalidSpec
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
