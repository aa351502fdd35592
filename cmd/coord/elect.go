package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/go-coord/coord"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// leaderInfo is what coord leader -o json prints.
type leaderInfo struct {
	Key      string `json:"key"`
	Identity string `json:"identity"`
	Token    int64  `json:"token"` // the leader key's create revision: the fencing token
	Lease    string `json:"lease"`
}

func cmdLeader(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c := newCmdFlags("leader", "KEY", `Print the identity of the leader of election KEY, the candidate of
KEY/<lease> created first (as etcd's concurrency package and "etcdctl elect"
see it). Exits with status 1 when the election has no leader. It only
reads: no lease or key is created.`, true)
	output := c.output("output `format`: text (the identity) or json", "text", "json")
	pos, err := c.parse(args, stdout, 1)
	if err != nil {
		return err
	}
	key := pos[0]
	if err := checkElectionKey(key); err != nil {
		return err
	}
	var kv *mvccpb.KeyValue
	err = c.conn.oneShot(ctx, func(rctx context.Context, cli *clientv3.Client) error {
		// coord's Election.Leader would do, but an Election holds a session:
		// it would grant a lease just to read a key.
		resp, err := cli.Get(rctx, key+"/", clientv3.WithFirstCreate()...)
		if err != nil {
			return c.conn.explain(ctx, cli, fmt.Errorf("read leader of %s: %w", key, err))
		}
		if len(resp.Kvs) == 0 {
			return fmt.Errorf("election %s has no leader", key)
		}
		kv = resp.Kvs[0]
		return nil
	})
	if err != nil {
		return err
	}
	if *output == "json" {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(leaderInfo{Key: key, Identity: string(kv.Value), Token: kv.CreateRevision, Lease: fmt.Sprintf("%x", kv.Lease)})
	}
	_, err = fmt.Fprintln(stdout, string(kv.Value))
	return err
}

func cmdCampaign(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c := newCmdFlags("campaign", "KEY IDENTITY", `Campaign in election KEY as IDENTITY, wait to lead, and hold leadership
until interrupted (Ctrl-C, SIGTERM); then resign, so the next candidate
leads at once. A line is printed when leadership is gained and when it ends.
Exits with status 1 if leadership is lost, saying why (the leader key
deleted, the lease expired or revoked, renewals unanswered while etcd was
unreachable); an interrupt before or while leading exits with 0.`, true)
	ttl := c.Duration("ttl", coord.DefaultElectionTTL, "TTL of the campaign's session: a whole number of seconds.\nIf this process dies, the next candidate leads about this long after")
	pos, err := c.parse(args, stdout, 2)
	if err != nil {
		return err
	}
	key, identity := pos[0], pos[1]
	if err := checkElectionKey(key); err != nil {
		return err
	}
	if *ttl <= 0 || *ttl%time.Second != 0 {
		return usagef("--ttl %v: want a positive whole number of seconds", *ttl)
	}
	cli, err := c.conn.connect(ctx)
	if err != nil {
		return err
	}
	defer cli.Close()
	e, err := newCampaignElection(ctx, c.conn, cli, coord.ElectionOptions{Key: key, TTL: *ttl, Identity: identity}, stderr)
	if err != nil {
		if ctx.Err() != nil {
			return nil // interrupted before campaigning
		}
		return err
	}
	// Close resigns too; it is bounded by about one TTL.
	defer e.Close()
	return campaignAndHold(ctx, e, c.conn.commandTimeout, key, identity, stdout, stderr)
}

// newCampaignElection creates the election of coord campaign, within the
// command timeout.
func newCampaignElection(ctx context.Context, conn *connFlags, cli *clientv3.Client, opts coord.ElectionOptions, stderr io.Writer) (*coord.Election, error) {
	// The election's warnings would repeat what campaign reports; one even
	// comes with every Resign (its own delete of the leader key races the
	// watch that ends leadership).
	if conn.debug {
		opts.Logger = conn.logger(stderr)
	}
	nctx, cancel := context.WithTimeout(ctx, conn.commandTimeout)
	defer cancel()
	return coord.NewElection(nctx, cli, opts)
}

// campaignAndHold campaigns in e, holds leadership until ctx ends, and
// then resigns, within timeout, so that the next candidate leads at once.
// Leadership lost before ctx ends is an error; ctx ending before e leads
// is not.
func campaignAndHold(ctx context.Context, e *coord.Election, timeout time.Duration, key, identity string, stdout, stderr io.Writer) error {
	fmt.Fprintf(stderr, "coord: campaigning in %s as %q (Ctrl-C to stop)\n", key, identity)
	if leader, err := e.Leader(ctx); err == nil {
		fmt.Fprintf(stderr, "coord: %q leads %s: waiting in line\n", leader, key)
	}
	if err := e.Campaign(ctx, identity); err != nil {
		if ctx.Err() != nil {
			// Campaign left no candidate key behind.
			fmt.Fprintf(stdout, "%s  interrupted before leading %s\n", time.Now().Format(timestamp), key)
			return nil
		}
		return err
	}
	fmt.Fprintf(stdout, "%s  leading %s as %q (token %d)\n", time.Now().Format(timestamp), key, identity, e.Token())
	return hold(ctx, e.Done(), "campaign in "+key, e.Err, e.Resign, timeout,
		func() { fmt.Fprintf(stdout, "%s  resigned from %s\n", time.Now().Format(timestamp), key) })
}

// hold waits until done closes (an error saying what was lost and why,
// as why() says it, unless ctx ended too) or ctx ends, then gives up
// what it held with release, within timeout, and reports it with
// released.
func hold(ctx context.Context, done <-chan struct{}, what string, why func() error, release func(context.Context) error, timeout time.Duration, released func()) error {
	select {
	case <-done:
		if ctx.Err() == nil {
			return lostError{what, why()}
		}
	case <-ctx.Done():
	}
	rctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if err := release(rctx); err != nil {
		return err
	}
	released()
	return nil
}

// lostError says what was lost, and why: the library's error, whose
// "coord: " errorLine says once, in front.
type lostError struct {
	what string
	err  error
}

func (e lostError) Error() string {
	return e.what + ": " + strings.TrimPrefix(e.err.Error(), "coord: ")
}
func (e lostError) Unwrap() error { return e.err }

// checkElectionKey applies coord's rule for election keys, so that a bad
// key is a usage error found before dialling.
func checkElectionKey(key string) error { return checkKey("election", key) }

// checkKey applies coord's rule for election and semaphore keys (noun).
func checkKey(noun, key string) error {
	if key == "" || strings.HasSuffix(key, "/") || strings.Contains(key, "//") {
		return usagef("%s key %q: want non-empty, no trailing /, no //", noun, key)
	}
	return nil
}
