package coord

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Sentinel errors. Errors returned by coord wrap them (test with errors.Is)
// together with what was being done.
var (
	// ErrNilClient is returned when a nil *clientv3.Client is passed.
	ErrNilClient = errors.New("coord: nil etcd client")
	// ErrInvalidHostUUID is returned for an empty HostUUID, one containing
	// "/", or an Update that changes the HostUUID.
	ErrInvalidHostUUID = errors.New("coord: invalid host UUID")
	// ErrInvalidKey is returned for a prefix that does not end in "/", or an
	// election key that is not a clean etcd prefix.
	ErrInvalidKey = errors.New("coord: invalid key")
	// ErrInvalidTTL is returned for a TTL that is negative or not a whole
	// number of seconds, and for a negative WatcherOptions.UnhealthyAfter.
	ErrInvalidTTL = errors.New("coord: invalid TTL")
	// ErrInvalidBuffer is returned for a negative WatcherOptions.Buffer,
	// MaxBacklog or PageSize.
	ErrInvalidBuffer = errors.New("coord: invalid buffer size")
	// ErrHostExists is returned when the host key is held by another live
	// lease, and is the Err of a registration that was taken over.
	ErrHostExists = errors.New("coord: host already registered")
	// ErrClosed is returned by methods called after Stop or Close.
	ErrClosed = errors.New("coord: closed")
	// ErrClientClosed is the cause reported when the caller's etcd client
	// was closed underneath a registration, watcher or election.
	ErrClientClosed = errors.New("coord: etcd client closed")
	// ErrNotLeader is returned by Proclaim when the election is not led by us.
	ErrNotLeader = errors.New("coord: not leader")
	// ErrNoLeader is returned by Leader when the election has no leader.
	ErrNoLeader = errors.New("coord: no leader")
	// ErrLeadershipLost is why a term ended that was lost rather than
	// given up (renewals unanswered, lease expired or revoked, key
	// deleted): Election.Err, the cause of a ShardSet Run's ctx; and what
	// ErrPermitLost wraps.
	ErrLeadershipLost = errors.New("coord: leadership lost")
	// ErrResigned is why a leadership ended after Resign, and what a
	// Campaign withdrawn by Resign returns (wrapped).
	ErrResigned = errors.New("coord: resigned")
	// ErrInUse is returned by ElectionPool.Election for a key whose
	// Election is held by another caller until its Close, and, with a
	// Host, by ElectionPool.Election and NewSemaphore for a key that
	// another pool or semaphore on the same host holds.
	ErrInUse = errors.New("coord: election in use")
	// ErrInvalidKeysPerSession is returned for a negative
	// PoolOptions.KeysPerSession or ShardOptions.KeysPerSession.
	ErrInvalidKeysPerSession = errors.New("coord: invalid keys per session")
	// ErrInvalidShards is returned for ShardOptions whose Shards, Self or
	// Run are missing or invalid.
	ErrInvalidShards = errors.New("coord: invalid shards")
	// ErrHostGone is why a ShardSet tied to our registration
	// (ShardOptions.Host) ended: the registration ended for good. With
	// PoolOptions.Host or SemaphoreOptions.Host, it is why the terms on
	// its lease ended then, and what Campaign and Acquire return since.
	ErrHostGone = errors.New("coord: host registration gone")
	// ErrNoPermit is returned by Semaphore.TryAcquire when every permit
	// is held.
	ErrNoPermit = errors.New("coord: no permit available")
	// ErrReleased is why a permit ended after its Release.
	ErrReleased = errors.New("coord: permit released")
	// ErrLimitMismatch is returned by NewSemaphore when the semaphore's
	// key holds another Limit than the one asked for.
	ErrLimitMismatch = errors.New("coord: semaphore limit mismatch")
	// ErrInvalidLimit is returned for a SemaphoreOptions.Limit below 1.
	ErrInvalidLimit = errors.New("coord: invalid semaphore limit")
	// ErrRebalanced is why a ShardSet Run's ctx ended when the shard is
	// to go to another member: a better-ranked one is ready to take it,
	// or the members changed and we are no longer among its candidates.
	ErrRebalanced = errors.New("coord: shard rebalanced")
	// ErrDraining is why a ShardSet Run's ctx ended when Drain hands its
	// shard over.
	ErrDraining = errors.New("coord: draining")
	// ErrPermitLost is why a permit ended that was lost rather than
	// released (Permit.Err): errors.Is(err, ErrLeadershipLost) holds too.
	ErrPermitLost error = permitLost{}
)

// permitLost is ErrPermitLost: a permit is not a leadership, but code
// written for either loss catches both.
type permitLost struct{}

func (permitLost) Error() string        { return "coord: permit lost" }
func (permitLost) Is(target error) bool { return target == ErrLeadershipLost }

// fatal returns the error that ends the caller's work for good when err
// (or the state of ctx and the client) says it will not go away by
// retrying: ctx ended, the client was closed, our registration ended (for
// keys that ride its lease), or etcd refused the request (permission
// denied, bad request, request too large). It returns nil for errors
// worth retrying.
func fatal(ctx context.Context, cli *clientv3.Client, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if errors.Is(err, ErrHostGone) {
		return ErrHostGone
	}
	if cli.Ctx().Err() != nil {
		return ErrClientClosed
	}
	if ee, ok := etcdError(err); ok && (ee.Code() == codes.PermissionDenied || ee.Code() == codes.InvalidArgument) {
		return ee
	}
	// A message larger than etcd takes never passes; "too many requests"
	// (the same code) does, later.
	if status.Code(err) == codes.ResourceExhausted && !errors.Is(rpctypes.Error(err), rpctypes.ErrTooManyRequests) {
		return err
	}
	return nil
}

// etcdError returns the etcd error err is, also when only its text is
// left: a watch that etcd refuses reports the refusal as text.
func etcdError(err error) (rpctypes.EtcdError, bool) {
	_, desc, _ := strings.Cut(fmt.Sprint(err), "desc = ")
	var ee rpctypes.EtcdError
	ok := errors.As(rpctypes.Error(err), &ee) || errors.As(rpctypes.Error(errors.New(desc)), &ee)
	return ee, ok
}

// opErr is what an exported entry point returns: what it was doing, and
// the cause, wrapped. The message says "coord:" once: the cause's own
// leading "coord: " (a sentinel's) is dropped from the text. The etcd
// client returns the call's ctx's own error when that ctx ended, so
// errors.Is(err, ctx.Err()) holds then.
func opErr(what string, err error) error { return &opError{what: what, err: err} }

type opError struct {
	what string
	err  error
}

func (e *opError) Error() string {
	return "coord: " + e.what + ": " + strings.TrimPrefix(e.err.Error(), "coord: ")
}

func (e *opError) Unwrap() error { return e.err }

// Why an object that was stopped or closed is not healthy: it no longer
// does what it promises.
var (
	errStopped = errors.New("stopped")
	errHClosed = errors.New("closed")
)

// bare is err without its leading "coord: ", for a message that says it
// once already.
type bare struct{ error }

func (b bare) Error() string { return strings.TrimPrefix(b.error.Error(), "coord: ") }
func (b bare) Unwrap() error { return b.error }
