#!/usr/bin/env bash
# Makes sure PostgreSQL, MariaDB and Redis listen on loopback for the test suites and benches,
# installing and starting what is missing (Debian, as root). Idempotent: where a server already
# runs, it is only checked, and the test role and database are created if absent.
#
# Usage:   eval "$(scripts/services.sh)"        # from the project root
# Prints on stdout only `export` lines:
#   DLOCK_TEST_PG_URL, DLOCK_TEST_PGBOUNCER_URL, DLOCK_TEST_MYSQL_URL, DLOCK_TEST_REDIS_URL
# Progress and errors go to stderr. Exits non-zero if a server cannot be brought up.
# Set SERVICES="pg mysql" (any of pg, pgbouncer, mysql, redis) to handle only some of them
# (pgbouncer needs pg).
#
# PgBouncer runs in front of that PostgreSQL on 127.0.0.1:6432 in `pool_mode = transaction`
# (the mode that breaks session locks and named prepared statements), with its own config,
# auth file, pid file and log in $DLOCK_PGBOUNCER_DIR (default /var/tmp/dlock-pgbouncer),
# as the postgres user (PgBouncer refuses to run as root).
set -euo pipefail

SERVICES=${SERVICES:-"pg pgbouncer mysql redis"}
say() { echo "services: $*" >&2; }
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_port() { for _ in $(seq 1 120); do port_open "$1" && return 0; sleep 0.5; done; return 1; }
wants() { [[ " $SERVICES " == *" $1 "* ]]; }

apt_install() {
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  say "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >&2
  apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
}

# Client libraries that diesel's postgres and mysql features link against.
apt_install libpq-dev default-libmysqlclient-dev pkg-config

if wants pg; then
  if ! port_open 5432; then
    apt_install postgresql
    ver=$(ls /etc/postgresql | sort -V | tail -n 1)
    say "starting PostgreSQL $ver"
    pg_ctlcluster --skip-systemctl-redirect "$ver" main start >&2 || pg_ctlcluster "$ver" main start >&2
    wait_port 5432 || { say "PostgreSQL did not come up on 5432"; exit 1; }
  fi
  pg_admin() { # superuser SQL over whichever path this machine allows
    su postgres -c "psql -XqAt -v ON_ERROR_STOP=1 -c \"$1\"" 2>/dev/null ||
      psql -XqAt -h 127.0.0.1 -U postgres -d postgres -v ON_ERROR_STOP=1 -c "$1"
  }
  pg_admin "SELECT 1" >/dev/null || { say "no superuser access to PostgreSQL"; exit 1; }
  [ "$(pg_admin "SELECT 1 FROM pg_roles WHERE rolname='dlock'")" = 1 ] ||
    pg_admin "CREATE ROLE dlock LOGIN PASSWORD 'dlock'" >/dev/null
  # Tests that purge make (and drop) a database of their own, dlock_t_<pid>_<unique>.
  [ "$(pg_admin "SELECT 1 FROM pg_roles WHERE rolname='dlock' AND rolcreatedb")" = 1 ] ||
    pg_admin "ALTER ROLE dlock CREATEDB" >/dev/null
  [ "$(pg_admin "SELECT 1 FROM pg_database WHERE datname='dlock_test'")" = 1 ] ||
    pg_admin "CREATE DATABASE dlock_test OWNER dlock" >/dev/null
  # Sessions of the test role left by an earlier run: a process a test or an adversary
  # stopped (SIGSTOP) and never resumed, or a harness that died mid-way. One sitting in a
  # transaction keeps its row locks and holds back every vacuum; many of them take the
  # server's connection slots (100 here; the suite itself opens up to ~75 at once). A CI run
  # on a machine left so lost leases to renewals that could not get through (scale tests).
  # Those idle in a transaction for over 5 minutes are ended (no test's transaction lasts
  # that long: the library bounds its own to seconds); the rest are counted.
  ended=$(pg_admin "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                    WHERE usename = 'dlock' AND state LIKE 'idle in transaction%' \
                      AND state_change < now() - interval '5 minutes'")
  [ "$ended" = 0 ] ||
    say "ended $ended session(s) of role dlock idle in a transaction for over 5 minutes (an earlier run's)"
  open_now=$(pg_admin "SELECT count(*) FROM pg_stat_activity WHERE usename = 'dlock'")
  [ "$open_now" -le 20 ] ||
    say "warning: $open_now sessions of role dlock already open on PostgreSQL (an earlier run's processes still alive, stopped?); the suite needs ~75 of its $(pg_admin "SHOW max_connections") slots"
  # A server without autovacuum (this machine's configuration file turns it off) keeps every
  # dead row the suite's churn leaves in the shared test database: 143k in dlock_leases and
  # 113k in dlock_waiters beside 19 and 17 live ones after a few runs, which every turn check
  # and hand-over then reads (the suite took 1,131 s instead of 800). A vacuum before the run.
  if [ "$(pg_admin "SHOW autovacuum")" = off ]; then
    su postgres -c "psql -XqAt -d dlock_test -c 'VACUUM (ANALYZE)'" >/dev/null 2>&1 ||
      psql -XqAt -h 127.0.0.1 -U postgres -d dlock_test -c "VACUUM (ANALYZE)" >/dev/null ||
      say "could not vacuum dlock_test (autovacuum is off): the suite runs slower"
  fi
  echo "export DLOCK_TEST_PG_URL=postgres://dlock:dlock@127.0.0.1:5432/dlock_test"
  # No TLS on loopback: the same exit-time race in OpenSSL as PgBouncer's SCRAM (below).
  echo "export PGSSLMODE=disable"
fi

if wants pgbouncer; then
  wants pg || { say "pgbouncer needs pg in SERVICES"; exit 1; }
  dir=${DLOCK_PGBOUNCER_DIR:-/var/tmp/dlock-pgbouncer}
  if port_open 6432 && ! { [ -f "$dir/pgbouncer.pid" ] && kill -0 "$(cat "$dir/pgbouncer.pid")" 2>/dev/null; }; then
    # Not ours (Debian's own pgbouncer service, say): its pool mode and databases are unknown.
    say "something other than this script's PgBouncer listens on 6432; stop it first"
    exit 1
  fi
  if ! port_open 6432; then
    apt_install pgbouncer
    install -d -o postgres -g postgres -m 0700 "$dir"
    # `*`: the tests' own databases (dlock_t_…) go through too. Idle server connections
    # are closed after 10 s: the shared PostgreSQL has 100 connection slots in all.
    # auth_type = trust (it listens on loopback only): libpq's SCRAM runs OpenSSL's HMAC,
    # and r2d2 opens connections on threads of its own; a test process exiting while one
    # of them authenticates crashed in OpenSSL's exit-time cleanup (SIGSEGV, 45 of 300 runs
    # of one test).
    cat > "$dir/pgbouncer.ini" <<INI
[databases]
* = host=127.0.0.1 port=5432

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = 6432
unix_socket_dir =
pool_mode = transaction
auth_type = trust
auth_file = $dir/userlist.txt
max_client_conn = 1000
default_pool_size = 40
server_idle_timeout = 10
ignore_startup_parameters = extra_float_digits
pidfile = $dir/pgbouncer.pid
logfile = $dir/pgbouncer.log
INI
    echo '"dlock" "dlock"' > "$dir/userlist.txt"
    chown postgres:postgres "$dir/pgbouncer.ini" "$dir/userlist.txt"
    chmod 0600 "$dir/userlist.txt"
    say "starting PgBouncer (transaction pooling) on 6432"
    pgbouncer -d -u postgres "$dir/pgbouncer.ini" >&2
    wait_port 6432 || { say "PgBouncer did not come up on 6432"; exit 1; }
  fi
  # dlock_pooler=transaction: diesel_lock::connect() turns diesel's prepared-statement cache
  # off for this pool (docs/guide.md, "Behind a connection pooler").
  echo "export DLOCK_TEST_PGBOUNCER_URL=postgres://dlock:dlock@127.0.0.1:6432/dlock_test?dlock_pooler=transaction"
fi

if wants mysql; then
  if ! port_open 3306; then
    apt_install mariadb-server
    say "starting MariaDB"
    install -d -o mysql -g mysql /run/mysqld
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd -- --user=mysql >&2
    wait_port 3306 || { say "MariaDB did not come up on 3306"; exit 1; }
  fi
  my_admin() {
    mariadb -u root "${@:2}" -e "$1" 2>/dev/null || mariadb -h 127.0.0.1 -P 3306 -u root "${@:2}" -e "$1"
  }
  my_admin "SELECT 1" >/dev/null || { say "no root access to MariaDB"; exit 1; }
  my_admin "CREATE DATABASE IF NOT EXISTS dlock_test;
            CREATE USER IF NOT EXISTS 'dlock'@'127.0.0.1' IDENTIFIED BY 'dlock';
            CREATE USER IF NOT EXISTS 'dlock'@'localhost' IDENTIFIED BY 'dlock';
            GRANT ALL ON dlock_test.* TO 'dlock'@'127.0.0.1';
            GRANT ALL ON dlock_test.* TO 'dlock'@'localhost';
            GRANT PROCESS ON *.* TO 'dlock'@'127.0.0.1';
            GRANT PROCESS ON *.* TO 'dlock'@'localhost';
            -- Scratch databases of the tests that purge or migrate, dlock_t_<pid>_<unique>.
            GRANT ALL ON \`dlock\\_t\\_%\`.* TO 'dlock'@'127.0.0.1';
            GRANT ALL ON \`dlock\\_t\\_%\`.* TO 'dlock'@'localhost';"
  # As for PostgreSQL above: the test role's transactions open for over 5 minutes are an
  # earlier run's leftovers (their row locks stall every acquisition of their keys): ended.
  for id in $(my_admin "SELECT t.trx_mysql_thread_id FROM information_schema.INNODB_TRX t
                        JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id
                        WHERE p.USER = 'dlock' AND t.trx_started < NOW() - INTERVAL 5 MINUTE" -N); do
    my_admin "KILL CONNECTION $id" >/dev/null 2>&1 &&
      say "ended MariaDB session $id of role dlock, in a transaction for over 5 minutes (an earlier run's)"
  done
  echo "export DLOCK_TEST_MYSQL_URL=mysql://dlock:dlock@127.0.0.1:3306/dlock_test"
fi

if wants redis; then
  if ! port_open 6379; then
    apt_install redis-server
    say "starting Redis"
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
      --dir /tmp --logfile /tmp/dlock-redis.log >&2
    wait_port 6379 || { say "Redis did not come up on 6379"; exit 1; }
  fi
  echo "export DLOCK_TEST_REDIS_URL=redis://127.0.0.1:6379/"
fi
