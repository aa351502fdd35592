// Command coord is a demo of the coord library that runs in one command, and
// a set of operator tools for the hosts and elections of a live etcd cluster.
//
//	coord demo                      # embedded etcd, simulated agents, crashes, failover
//	coord etcd                      # a development etcd on 127.0.0.1:2379 until Ctrl-C
//	coord hosts -o json             # the live hosts under --prefix
//	coord watch                     # host events until Ctrl-C
//	coord leader KEY                # the leader of an election
//	coord campaign KEY IDENTITY     # lead until Ctrl-C, then resign
//	coord semaphore KEY             # the limit, holders and waiters of a semaphore
//	coord acquire KEY --limit N     # hold a permit until Ctrl-C, then release it
//	coord shards                    # each shard's owner and standbys
//	coord ui                        # a live web page of the fleet on 127.0.0.1:8080
//
// Connection flags follow etcdctl's (--endpoints, --cacert, --cert, --key,
// --user, --dial-timeout) and go before or after the command. Exit status:
// 0 ok, 1 error, 2 usage error.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/go-coord/coord"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	// After the first signal, give the default behaviour back: should a
	// clean shutdown ever stall, a second Ctrl-C kills the process.
	go func() {
		<-ctx.Done()
		stop()
	}()
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// Exit statuses.
const (
	exitOK    = 0
	exitError = 1
	exitUsage = 2
)

// command is a subcommand. Its run returns nil on success, flag.ErrHelp once
// it has printed its help, a *usageError for bad flags or arguments, and
// any other error for a failure.
type command struct {
	name    string
	args    string // synopsis of the arguments, after the name
	summary string
	run     func(ctx context.Context, args []string, stdout, stderr io.Writer) error
}

func commands() []command {
	return []command{
		{"demo", "", "run a self-contained demo: embedded etcd, agents, crashes, failover", cmdDemo},
		{"etcd", "", "run a development etcd (embedded, short leases) until interrupted", cmdEtcd},
		{"hosts", "", "list the live hosts under --prefix", cmdHosts},
		{"watch", "", "stream host events until interrupted", cmdWatch},
		{"leader", "KEY", "print the identity of the leader of election KEY", cmdLeader},
		{"campaign", "KEY IDENTITY", "lead election KEY as IDENTITY until interrupted, then resign", cmdCampaign},
		{"semaphore", "KEY", "list the limit, holders and waiters of semaphore KEY", cmdSemaphore},
		{"acquire", "KEY [IDENTITY]", "hold a permit of semaphore KEY until interrupted, then release it", cmdAcquire},
		{"shards", "", "list the shards under --prefix: owner, fencing token, standbys", cmdShards},
		{"ui", "", "serve a live web page of the fleet: hosts, elections, shards, semaphores", cmdUI},
		{"agent", "", "run an agent: register, own shards, campaign, hold a permit, until interrupted", cmdAgent},
		{"bench", "", "run the benchmarks (see coord bench -h)", cmdBench},
	}
}

func lookup(name string) (command, bool) {
	for _, c := range commands() {
		if c.name == name {
			return c, true
		}
	}
	return command{}, false
}

// run runs the coord command line args and returns the exit status. ctx
// ending (Ctrl-C) is how watch and campaign are told to finish.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	name, err := dispatch(ctx, args, stdout, stderr)
	var uerr *usageError
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
		return exitOK
	case errors.As(err, &uerr):
		if name == "" {
			fmt.Fprintf(stderr, "coord: %v\nRun 'coord -h' for usage.\n", uerr.err)
		} else {
			fmt.Fprintf(stderr, "coord %s: %v\nRun 'coord %s -h' for usage.\n", name, uerr.err, name)
		}
		return exitUsage
	default:
		fmt.Fprintln(stderr, errorLine(err))
		return exitError
	}
}

// errorLine is the line that reports err, saying "coord: " once: the
// library's errors begin with it (its sentinels and entry points add it),
// the command's own errors do not.
func errorLine(err error) string {
	const prefix = "coord: "
	if msg := err.Error(); strings.HasPrefix(msg, prefix) {
		return msg
	}
	return prefix + err.Error()
}

// dispatch parses the flags given before the command and runs the command,
// handing it those flags ahead of its own arguments: every command parses
// the connection flags itself, so they may come before or after its name.
// It returns the name of the command run, "" if none.
func dispatch(ctx context.Context, args []string, stdout, stderr io.Writer) (string, error) {
	fs := newFlagSet("coord")
	var conn connFlags
	conn.register(fs)
	conn.registerPrefix(fs)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			mainUsage(stdout, fs)
			return "", err
		}
		return "", &usageError{err}
	}
	rest := fs.Args()
	if len(rest) == 0 {
		return "", usagef("no command given")
	}
	name := rest[0]
	if name == "help" {
		if len(rest) == 1 {
			mainUsage(stdout, fs)
			return "", nil
		}
		name, rest = rest[1], []string{rest[1], "-h"}
	}
	cmd, ok := lookup(name)
	if !ok {
		return "", usagef("unknown command %q", name)
	}
	var global []string
	fs.Visit(func(f *flag.Flag) {
		global = append(global, "--"+f.Name+"="+f.Value.String())
	})
	return name, cmd.run(ctx, append(global, rest[1:]...), stdout, stderr)
}

func mainUsage(w io.Writer, fs *flag.FlagSet) {
	fmt.Fprint(w, `coord: leader election and host liveness on etcd.
A demo that needs no setup, and tools for the hosts and elections of a live
cluster.

Usage:
  coord [connection flags] COMMAND [flags] [arguments]

Commands:
`)
	for _, c := range commands() {
		fmt.Fprintf(w, "  %-23s %s\n", strings.TrimSpace(c.name+" "+c.args), c.summary)
	}
	fmt.Fprintln(w, "\nConnection flags (before or after the command; --prefix: hosts and watch, and\nshards with the shards' prefix, default "+coord.ShardsPrefix+"):")
	printFlags(w, fs, nil)
	fmt.Fprint(w, `
Run 'coord COMMAND -h' (or 'coord help COMMAND') for the flags of a command.
Exit status: 0 ok, 1 error, 2 usage error.
`)
}

// usageError is a bad flag or argument: exit status 2.
type usageError struct{ err error }

func (e *usageError) Error() string { return e.err.Error() }
func (e *usageError) Unwrap() error { return e.err }

func usagef(format string, args ...any) error {
	return &usageError{fmt.Errorf(format, args...)}
}

// cmdFlags is the flag set of a command, with the connection flags unless
// the command does not connect to etcd (demo).
type cmdFlags struct {
	*flag.FlagSet
	name  string
	args  string // synopsis of the positional arguments
	about string // what the command does, for -h
	conn  *connFlags

	format  *string  // -o, if the command has it
	formats []string // the values -o takes
	// optional is how many positional arguments may follow those parse
	// wants.
	optional int
}

// output adds -o, the output format: one of formats, the first the
// default. parse refuses any other value.
func (c *cmdFlags) output(usage string, formats ...string) *string {
	c.format, c.formats = c.String("o", formats[0], usage), formats
	return c.format
}

// newFlagSet returns a FlagSet that prints nothing itself: run reports
// parse errors, and -h prints the help on stdout.
func newFlagSet(name string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	return fs
}

func newCmdFlags(name, args, about string, withConn bool) *cmdFlags {
	c := &cmdFlags{FlagSet: newFlagSet(name), name: name, args: args, about: about}
	if withConn {
		c.conn = &connFlags{}
		c.conn.register(c.FlagSet)
	}
	return c
}

// explainFlagErr adds to the flag package's "invalid value" error of a
// duration flag what a duration looks like.
func (c *cmdFlags) explainFlagErr(err error) error {
	_, rest, ok := strings.Cut(err.Error(), " for flag -")
	if !ok {
		return err
	}
	name, _, _ := strings.Cut(rest, ":")
	if f := c.Lookup(name); f != nil {
		if g, ok := f.Value.(flag.Getter); ok {
			if _, ok := g.Get().(time.Duration); ok {
				return fmt.Errorf("%w: want a duration such as 2s or 500ms", err)
			}
		}
	}
	return err
}

// parse parses args, flags and positional arguments in any order (as in
// "coord campaign KEY ID --endpoints h:2379"; "--" ends the flags), and
// returns the positional arguments, checking there are want of them
// (and up to c.optional more).
// On -h it prints the help on stdout and returns flag.ErrHelp.
// A duration flag given a bare number (--ttl 2) says what it wants.
func (c *cmdFlags) parse(args []string, stdout io.Writer, want int) ([]string, error) {
	var pos []string
	for {
		if err := c.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				c.usage(stdout)
				return nil, err
			}
			return nil, &usageError{c.explainFlagErr(err)}
		}
		rest := c.Args()
		if n := len(args) - len(rest); n > 0 && args[n-1] == "--" {
			pos = append(pos, rest...)
			break
		}
		if len(rest) == 0 {
			break
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
	switch {
	case len(pos) < want:
		return nil, usagef("missing arguments: want %s", c.args)
	case len(pos) > want+c.optional && want == 0:
		return nil, usagef("unexpected argument %q", pos[c.optional])
	case len(pos) > want+c.optional:
		return nil, usagef("too many arguments: want %s", c.args)
	case c.format != nil && !slices.Contains(c.formats, *c.format):
		return nil, usagef("-o %q: want %s", *c.format, strings.Join(c.formats, " or "))
	}
	return pos, nil
}

func (c *cmdFlags) usage(w io.Writer) {
	fmt.Fprintf(w, "Usage: coord %s [flags]", c.name)
	if c.args != "" {
		fmt.Fprintf(w, " %s", c.args)
	}
	fmt.Fprintf(w, "\n\n%s\n", c.about)
	own := func(f *flag.Flag) bool { return !isConnFlag(f.Name) }
	if countFlags(c.FlagSet, own) > 0 {
		fmt.Fprintln(w, "\nFlags:")
		printFlags(w, c.FlagSet, own)
	}
	if c.conn != nil {
		fmt.Fprintln(w, "\nConnection flags:")
		printFlags(w, c.FlagSet, func(f *flag.Flag) bool { return isConnFlag(f.Name) })
	}
}

func countFlags(fs *flag.FlagSet, keep func(*flag.Flag) bool) int {
	n := 0
	fs.VisitAll(func(f *flag.Flag) {
		if keep(f) {
			n++
		}
	})
	return n
}

// printFlags prints the flags of fs that keep selects (nil: all), the way
// they are usually typed: -o, but --endpoints.
func printFlags(w io.Writer, fs *flag.FlagSet, keep func(*flag.Flag) bool) {
	fs.VisitAll(func(f *flag.Flag) {
		if keep != nil && !keep(f) {
			return
		}
		dash := "--"
		if len(f.Name) == 1 {
			dash = "-"
		}
		name, usage := flag.UnquoteUsage(f)
		line := "  " + dash + f.Name
		if name != "" {
			line += " " + name
		}
		fmt.Fprintf(w, "%s\n    \t%s", line, strings.ReplaceAll(usage, "\n", "\n    \t"))
		if def := f.DefValue; def != "" && def != "false" {
			fmt.Fprintf(w, " (default %s)", def)
		}
		fmt.Fprintln(w)
	})
}
