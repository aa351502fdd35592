package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/go-coord/coord"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// semaphoreInfo is what coord semaphore -o json prints.
type semaphoreInfo struct {
	Key     string       `json:"key"`
	Limit   int          `json:"limit"`
	Holders []permitInfo `json:"holders"` // by token
	Waiters []permitInfo `json:"waiters"` // in the order they will hold
}

// permitInfo is a permit key: held, or waiting in line.
type permitInfo struct {
	Identity string `json:"identity"`
	Token    int64  `json:"token"` // the key's create revision: the fencing token of a holder
	Lease    string `json:"lease"` // hex, as etcdctl shows lease IDs
}

func cmdSemaphore(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c := newCmdFlags("semaphore", "KEY", `Print the limit of semaphore KEY (stored at KEY by its first user), its
holders (the first LIMIT permit keys under KEY/, by create revision, each
with its fencing token) and its waiters, in the order they will hold.
Exits with status 1 when KEY holds no limit. It only reads: no lease or
key is created.`, true)
	output := c.output("output `format`: text (a table) or json", "text", "json")
	pos, err := c.parse(args, stdout, 1)
	if err != nil {
		return err
	}
	key := pos[0]
	if err := checkSemaphoreKey(key); err != nil {
		return err
	}
	var info semaphoreInfo
	err = c.conn.oneShot(ctx, func(rctx context.Context, cli *clientv3.Client) error {
		var err error
		if info, err = readSemaphore(rctx, cli, key); err != nil {
			return c.conn.explain(ctx, cli, err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	if *output == "json" {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(info)
	}
	return printSemaphore(stdout, info)
}

// readSemaphore reads the limit and the permit keys of semaphore key, in
// one transaction (one revision).
func readSemaphore(ctx context.Context, cli *clientv3.Client, key string) (semaphoreInfo, error) {
	info := semaphoreInfo{Key: key, Holders: []permitInfo{}, Waiters: []permitInfo{}}
	resp, err := cli.Txn(ctx).Then(clientv3.OpGet(key),
		clientv3.OpGet(key+"/", clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))).Commit()
	if err != nil {
		return info, fmt.Errorf("read semaphore %s: %w", key, err)
	}
	return decodeSemaphore(key, resp.Responses[0].GetResponseRange().Kvs, resp.Responses[1].GetResponseRange().Kvs)
}

// decodeSemaphore reads semaphore key from its limit key (limit: none, or
// that key) and its permit keys, by create revision.
func decodeSemaphore(key string, limit, permits []*mvccpb.KeyValue) (semaphoreInfo, error) {
	info := semaphoreInfo{Key: key, Holders: []permitInfo{}, Waiters: []permitInfo{}}
	if len(limit) == 0 {
		return info, fmt.Errorf("semaphore %s holds no limit: nobody has used it", key)
	}
	var err error
	if info.Limit, err = strconv.Atoi(string(limit[0].Value)); err != nil || info.Limit < 1 {
		return info, fmt.Errorf("semaphore %s: its key holds %q, not a limit", key, limit[0].Value)
	}
	for i, kv := range permits {
		p := permitInfo{Identity: string(kv.Value), Token: kv.CreateRevision, Lease: fmt.Sprintf("%x", kv.Lease)}
		if i < info.Limit {
			info.Holders = append(info.Holders, p)
		} else {
			info.Waiters = append(info.Waiters, p)
		}
	}
	return info, nil
}

// printSemaphore prints a semaphore: its limit, then its permits as a
// table, the holders first.
func printSemaphore(w io.Writer, info semaphoreInfo) error {
	fmt.Fprintf(w, "semaphore %s: limit %d, %d held, %d waiting\n", info.Key, info.Limit, len(info.Holders), len(info.Waiters))
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ROLE\tIDENTITY\tTOKEN\tLEASE")
	for _, p := range info.Holders {
		fmt.Fprintf(tw, "holder\t%s\t%d\t%s\n", dash(p.Identity), p.Token, p.Lease)
	}
	for _, p := range info.Waiters {
		fmt.Fprintf(tw, "waiting\t%s\t%d\t%s\n", dash(p.Identity), p.Token, p.Lease)
	}
	return tw.Flush()
}

func cmdAcquire(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c := newCmdFlags("acquire", "KEY [IDENTITY]", `Acquire a permit of semaphore KEY as IDENTITY (default: the host name),
waiting in line while LIMIT permits are held, and hold it until interrupted
(Ctrl-C, SIGTERM); then release it, so the next in line gets it at once. A
line is printed when the permit is acquired and when it ends. Every user of
KEY must give the same --limit. Exits with status 1 if the permit is lost,
saying why (its key deleted, the lease expired or revoked, renewals
unanswered while etcd was unreachable), or if the limit differs
from the one stored at KEY; an interrupt before or while holding exits
with 0.`, true)
	c.optional = 1
	limit := c.Int("limit", 0, "how many permits of KEY are held at once, fleet-wide (required)")
	ttl := c.Duration("ttl", coord.DefaultSemaphoreTTL, "TTL of the session holding the permit: a whole number of seconds.\nIf this process dies, its permit is freed about this long after")
	pos, err := c.parse(args, stdout, 1)
	if err != nil {
		return err
	}
	key, identity := pos[0], ""
	if len(pos) > 1 {
		identity = pos[1]
	} else {
		identity, _ = os.Hostname()
	}
	switch err := checkSemaphoreKey(key); {
	case err != nil:
		return err
	case *limit == 0:
		return usagef("--limit is required: how many permits of %s are held at once, fleet-wide", key)
	case *limit < 1:
		return usagef("--limit %d: want at least 1", *limit)
	case *ttl <= 0 || *ttl%time.Second != 0:
		return usagef("--ttl %v: want a positive whole number of seconds", *ttl)
	}
	cli, err := c.conn.connect(ctx)
	if err != nil {
		return err
	}
	defer cli.Close()
	opts := coord.SemaphoreOptions{Key: key, Limit: *limit, TTL: *ttl, Identity: identity}
	if c.conn.debug {
		opts.Logger = c.conn.logger(stderr)
	}
	nctx, cancel := context.WithTimeout(ctx, c.conn.commandTimeout)
	defer cancel()
	s, err := coord.NewSemaphore(nctx, cli, opts)
	if err != nil {
		if ctx.Err() != nil {
			return nil // interrupted before acquiring
		}
		return err
	}
	// Close releases too; it is bounded by about one TTL.
	defer s.Close()
	return acquireAndHold(ctx, s, c.conn.commandTimeout, identity, *limit, stdout, stderr)
}

// acquireAndHold acquires a permit of s, holds it until ctx ends, and
// then releases it, within timeout, so that the next in line gets it at
// once. The permit lost before ctx ends is an error; ctx ending before
// it is acquired is not.
func acquireAndHold(ctx context.Context, s *coord.Semaphore, timeout time.Duration, identity string, limit int, stdout, stderr io.Writer) error {
	key := s.Key()
	fmt.Fprintf(stderr, "coord: acquiring a permit of %s (limit %d) as %q (Ctrl-C to stop)\n", key, limit, identity)
	p, err := s.Acquire(ctx)
	if err != nil {
		if ctx.Err() != nil {
			// Acquire left no key behind.
			fmt.Fprintf(stdout, "%s  interrupted before acquiring a permit of %s\n", time.Now().Format(timestamp), key)
			return nil
		}
		return err
	}
	fmt.Fprintf(stdout, "%s  holding a permit of %s as %q (token %d)\n", time.Now().Format(timestamp), key, identity, p.Token())
	return hold(ctx, p.Done(), "acquire "+key, p.Err, p.Release, timeout,
		func() { fmt.Fprintf(stdout, "%s  released a permit of %s\n", time.Now().Format(timestamp), key) })
}

// checkSemaphoreKey applies coord's rule for semaphore keys (that of
// election keys), so that a bad key is a usage error found before
// dialling.
func checkSemaphoreKey(key string) error { return checkKey("semaphore", key) }
