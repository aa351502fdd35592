package coord

import (
	"context"
	"errors"
	"fmt"

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
	// number of seconds.
	ErrInvalidTTL = errors.New("coord: invalid TTL")
	// ErrInvalidBuffer is returned for a negative WatcherOptions.Buffer.
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
	// ErrLeadershipLost is returned by Campaign when our candidacy ended
	// (session expired, key deleted) before we became leader.
	ErrLeadershipLost = errors.New("coord: leadership lost")
)

// fatal reports whether err from etcd will not go away by retrying:
// the caller's context ended, the client was closed, or etcd refused the
// request for good (permission denied, bad request, request too large).
// It returns nil for errors worth retrying.
func fatal(ctx context.Context, cli *clientv3.Client, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if cli.Ctx().Err() != nil {
		return ErrClientClosed
	}
	switch status.Code(toGRPC(err)) {
	case codes.PermissionDenied, codes.InvalidArgument:
		return err
	}
	return nil
}

// toGRPC turns the etcd client's typed errors back into status errors so
// their code can be read.
func toGRPC(err error) error {
	var ee rpctypes.EtcdError
	if errors.As(err, &ee) {
		return status.Error(ee.Code(), ee.Error())
	}
	return err
}

// opErr wraps err, from an etcd call, with what was being done. The etcd
// client returns the call's ctx's own error when that ctx ended, so
// errors.Is(err, ctx.Err()) holds then.
func opErr(what string, err error) error {
	return fmt.Errorf("coord: %s: %w", what, err)
}

// clientCtx returns ctx, also ended when the client is closed: the etcd
// client otherwise retries a call on a closed connection for seconds.
func clientCtx(ctx context.Context, cli *clientv3.Client) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(cli.Ctx(), cancel)
	return ctx, func() { stop(); cancel() }
}
