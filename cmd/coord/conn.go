package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/go-coord/coord"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/status"
)

// connFlags are the flags that say how to reach etcd, named as etcdctl's.
type connFlags struct {
	endpoints      string
	dialTimeout    time.Duration
	commandTimeout time.Duration
	cacert         string
	cert           string
	key            string
	insecureSkip   bool
	user           string
	password       string
	prefix         string
	debug          bool
}

var connFlagNames = map[string]bool{
	"endpoints": true, "dial-timeout": true, "command-timeout": true,
	"cacert": true, "cert": true, "key": true, "insecure-skip-tls-verify": true,
	"user": true, "password": true, "debug": true,
}

func isConnFlag(name string) bool { return connFlagNames[name] }

func (c *connFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&c.endpoints, "endpoints", "127.0.0.1:2379", "comma-separated etcd `URLs` (https:// for TLS; a bare host:port uses TLS when a TLS flag is given)")
	fs.DurationVar(&c.dialTimeout, "dial-timeout", 2*time.Second, "how long to wait for etcd to answer before giving up")
	fs.DurationVar(&c.commandTimeout, "command-timeout", 5*time.Second, "bound of a one-shot request (hosts, leader, resigning)")
	fs.StringVar(&c.cacert, "cacert", "", "verify the servers' certificates with this CA bundle `file`")
	fs.StringVar(&c.cert, "cert", "", "client certificate `file` for TLS client authentication")
	fs.StringVar(&c.key, "key", "", "private key `file` of --cert")
	fs.BoolVar(&c.insecureSkip, "insecure-skip-tls-verify", false, "do not verify the servers' certificates (TLS)")
	fs.StringVar(&c.user, "user", "", "etcd user, as `user:password` (or give --password)")
	fs.StringVar(&c.password, "password", "", "`password` of --user")
	fs.BoolVar(&c.debug, "debug", false, "log the library's and etcd client's records on stderr")
}

// registerPrefix adds --prefix, for the commands that deal with hosts.
func (c *connFlags) registerPrefix(fs *flag.FlagSet) {
	fs.StringVar(&c.prefix, "prefix", coord.HostsPrefix, "etcd `prefix` under which hosts register; ends in /")
}

// check reports bad connection flags as usage errors, before any dialling.
func (c *connFlags) check() error {
	if len(c.endpointList()) == 0 {
		return usagef("--endpoints: no endpoint given")
	}
	if c.dialTimeout <= 0 {
		return usagef("--dial-timeout must be positive, got %v", c.dialTimeout)
	}
	if c.commandTimeout <= 0 {
		return usagef("--command-timeout must be positive, got %v", c.commandTimeout)
	}
	if (c.cert == "") != (c.key == "") {
		return usagef("--cert and --key go together")
	}
	if _, _, err := c.credentials(); err != nil {
		return err
	}
	if c.prefix != "" && !strings.HasSuffix(c.prefix, "/") {
		return usagef("--prefix %q must end in /", c.prefix)
	}
	return nil
}

func (c *connFlags) endpointList() []string {
	var eps []string
	for _, ep := range strings.Split(c.endpoints, ",") {
		if ep = strings.TrimSpace(ep); ep != "" {
			eps = append(eps, ep)
		}
	}
	return eps
}

// credentials splits --user as etcdctl does: at the first colon.
func (c *connFlags) credentials() (user, password string, err error) {
	if c.user == "" {
		if c.password != "" {
			return "", "", usagef("--password given without --user")
		}
		return "", "", nil
	}
	user, password, found := strings.Cut(c.user, ":")
	switch {
	case found && c.password != "":
		return "", "", usagef("password given twice: in --user and in --password")
	case !found:
		password = c.password
	}
	if user == "" || password == "" {
		return "", "", usagef("--user wants user:password (or --user user --password password)")
	}
	return user, password, nil
}

func (c *connFlags) tlsConfig() (*tls.Config, error) {
	if c.cacert == "" && c.cert == "" && !c.insecureSkip {
		return nil, nil
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: c.insecureSkip}
	if c.cacert != "" {
		pem, err := os.ReadFile(c.cacert)
		if err != nil {
			return nil, fmt.Errorf("--cacert: %w", err)
		}
		cfg.RootCAs = x509.NewCertPool()
		if !cfg.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--cacert: no PEM certificate in %s", c.cacert)
		}
	}
	if c.cert != "" {
		pair, err := tls.LoadX509KeyPair(c.cert, c.key)
		if err != nil {
			return nil, fmt.Errorf("--cert/--key: %w", err)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	return cfg, nil
}

// logger is the slog.Logger handed to the library. By default it shows
// only warnings (a value under the prefix that is not a host, a campaign
// that cannot withdraw...): the library's errors come back as errors, which
// run reports once. --debug shows every record.
func (c *connFlags) logger(stderr io.Writer) *slog.Logger {
	if c.debug {
		return slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	noTime := func(_ []string, a slog.Attr) slog.Attr {
		if a.Key == slog.TimeKey {
			return slog.Attr{}
		}
		return a
	}
	return slog.New(warnings{slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn, ReplaceAttr: noTime})})
}

// warnings passes on the warnings only.
type warnings struct{ slog.Handler }

func (h warnings) Enabled(ctx context.Context, l slog.Level) bool {
	return l == slog.LevelWarn && h.Handler.Enabled(ctx, l)
}

func (h warnings) WithAttrs(attrs []slog.Attr) slog.Handler {
	return warnings{h.Handler.WithAttrs(attrs)}
}

func (h warnings) WithGroup(name string) slog.Handler {
	return warnings{h.Handler.WithGroup(name)}
}

// connect dials etcd and checks, within --dial-timeout, that a member
// answers: clientv3.New returns before any connection is made (unless it
// authenticates), so an unreachable endpoint would otherwise show up only
// as a command hanging until its own deadline. The caller closes the client.
func (c *connFlags) connect(ctx context.Context) (*clientv3.Client, error) {
	if err := c.check(); err != nil {
		return nil, err
	}
	tlsCfg, err := c.tlsConfig()
	if err != nil {
		return nil, err
	}
	user, password, _ := c.credentials()
	eps := c.endpointList()
	log := zap.NewNop()
	if c.debug {
		log = zap.NewExample()
	}
	cfg := clientv3.Config{
		Endpoints:   eps,
		DialTimeout: c.dialTimeout,
		TLS:         tlsCfg,
		Logger:      log,
		// etcd's server refuses pings more frequent than every 5 s.
		DialKeepAliveTime:    10 * time.Second,
		DialKeepAliveTimeout: 5 * time.Second,
		DialOptions: []grpc.DialOption{
			// gRPC waits up to 20 s on one connection attempt and backs
			// off up to 120 s between attempts: too long to fail over to
			// another endpoint, or to come back after an etcd restart
			// while watching or campaigning.
			grpc.WithConnectParams(grpc.ConnectParams{
				Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 3 * time.Second},
				MinConnectTimeout: c.dialTimeout,
			}),
		},
	}
	where := strings.Join(eps, ",")
	deadline := time.Now().Add(c.dialTimeout)
	// Without credentials first: with them, New authenticates at once and,
	// if etcd cannot be reached, says no more than "context deadline
	// exceeded".
	cli, err := clientv3.New(cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to etcd at %s: %w", where, err)
	}
	if err := c.reachable(ctx, cli, deadline, where); err != nil {
		cli.Close()
		return nil, err
	}
	if user == "" {
		return cli, nil
	}
	cli.Close()
	cfg.Username, cfg.Password = user, password
	cfg.DialTimeout = max(time.Until(deadline), 100*time.Millisecond)
	cli, err = clientv3.New(cfg)
	if err != nil {
		return nil, fmt.Errorf("authenticate to etcd at %s as %s: %w", where, user, err)
	}
	return cli, nil
}

// oneShot connects, calls do with the client and a context bounded by
// --command-timeout, and closes the client.
func (c *connFlags) oneShot(ctx context.Context, do func(rctx context.Context, cli *clientv3.Client) error) error {
	cli, err := c.connect(ctx)
	if err != nil {
		return err
	}
	defer cli.Close()
	rctx, cancel := context.WithTimeout(ctx, c.commandTimeout)
	defer cancel()
	return do(rctx, cli)
}

// reachable checks that a member of the cluster answers before deadline.
// It asks for the member list, which needs no permission, reads
// linearizably (a member cut off from its quorum does not count) and goes
// through the client's own connection. It calls the gRPC stub itself and
// waits for a connection: the etcd client's MemberList would turn gRPC's
// "latest balancer error" (connection refused, certificate signed by
// unknown authority...) into a bare "context deadline exceeded".
//
// A member that answers but knows no leader is not "unreachable": the
// request requires a leader, so such a member refuses it at once (etcd's
// "no leader"), and it is asked again until deadline, as an election may be
// under way; then the cluster is said to have no leader. If the request is
// held until deadline instead (a member that has just lost its leader), the
// members are asked for their status to tell the two apart.
func (c *connFlags) reachable(ctx context.Context, cli *clientv3.Client, deadline time.Time, where string) error {
	vctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	rctx := clientv3.WithRequireLeader(vctx)
	noLeader := false
	for {
		_, err := pb.NewClusterClient(cli.ActiveConnection()).MemberList(rctx, &pb.MemberListRequest{Linearizable: true}, grpc.WaitForReady(true))
		var refused rpctypes.EtcdError
		switch {
		case errors.Is(rpctypes.Error(err), rpctypes.ErrNoLeader):
			noLeader = true
			t := time.NewTimer(noLeaderRetry)
			select {
			case <-t.C:
				continue
			case <-vctx.Done():
				t.Stop()
			}
		case err == nil, errors.As(rpctypes.Error(err), &refused):
			// An answer, if a refusal (with auth enabled, etcd wants a user
			// even for this): what the command asks for next tells why.
			return nil
		}
		switch {
		case ctx.Err() != nil:
			return fmt.Errorf("connect to etcd at %s: interrupted", where)
		case noLeader:
			return noLeaderError(where)
		case vctx.Err() != nil:
			if c.leaderless(ctx, cli) {
				return noLeaderError(where)
			}
			return fmt.Errorf("cannot reach etcd at %s within %v (--dial-timeout): %s", where, c.dialTimeout, status.Convert(err).Message())
		}
		return fmt.Errorf("connect to etcd at %s: %w", where, rpctypes.Error(err))
	}
}

// noLeaderRetry is how long reachable waits before asking again a member
// that knows no leader.
const noLeaderRetry = 50 * time.Millisecond

// noLeaderError is the error of a command when etcd answers but its
// cluster has no leader, so that nothing can be read or written.
func noLeaderError(where string) error {
	return fmt.Errorf("etcd at %s answers, but the cluster has no leader: quorum lost (a majority of its members down or cut off from each other)", where)
}

// explain returns the error of a command's request to etcd, err, as the
// operator should read it: the cluster has no leader when a member refused
// the request for that reason (the request requires a leader) or held it
// until it timed out while the members that answer their status know no
// leader. ctx is the command's, not the request's.
func (c *connFlags) explain(ctx context.Context, cli *clientv3.Client, err error) error {
	where := strings.Join(c.endpointList(), ",")
	switch {
	case ctx.Err() != nil:
		return err
	case errors.Is(err, rpctypes.ErrNoLeader):
		return noLeaderError(where)
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, rpctypes.ErrTimeout):
		if c.leaderless(ctx, cli) {
			return noLeaderError(where)
		}
	}
	return err
}

// leaderless reports whether a member answers a status request and none of
// those that answer knows a leader. It asks only if the client is connected
// to a member (an unreachable etcd is not kept waiting for), then every
// endpoint at once, each on a connection of its own, for --dial-timeout at
// most; an endpoint that refuses connections is not waited for. It is
// asked only once a request has failed: a command that succeeds never pays
// for it.
func (c *connFlags) leaderless(ctx context.Context, cli *clientv3.Client) bool {
	if cli.ActiveConnection().GetState() != connectivity.Ready {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, c.dialTimeout)
	defer cancel()
	type answer struct {
		ok     bool
		leader uint64 // 0: none
	}
	eps := c.endpointList()
	answers := make(chan answer, len(eps))
	for _, ep := range eps {
		go func() {
			var a answer
			if conn, err := cli.Dial(ep); err == nil {
				// Not WaitForReady: a refused connection fails at once.
				resp, err := pb.NewMaintenanceClient(conn).Status(ctx, &pb.StatusRequest{})
				conn.Close()
				if err == nil {
					a = answer{ok: true, leader: resp.Leader}
				}
			}
			answers <- a
		}()
	}
	answered, leader := false, false
	for range eps {
		a := <-answers
		answered = answered || a.ok
		if a.leader != 0 {
			leader = true
			cancel() // no need to wait for the others
		}
	}
	return answered && !leader
}

// timestamp is the time format of the lines of demo, watch and campaign.
const timestamp = "15:04:05.000"
