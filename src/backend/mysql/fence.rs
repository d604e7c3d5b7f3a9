//! MySQL's and MariaDB's fencing-token statements (`backend/fence.rs` has the scheme;
//! migration 6 the tables).
//!
//! The source is `UUID_SHORT()`: a server-wide counter, incremented under a mutex (so its
//! values come out in the order they are drawn), with no table to open (a MariaDB sequence
//! in the locking statement cost a quarter of the cycle), started at each start of the
//! server from the clock and `server_id`, which the offset makes irrelevant. Its top byte
//! is `server_id`'s, masked off (`& 72057594037927935`, 2^56 - 1) so that the value fits a signed BIGINT.
//!
//! The offset of the server's life lives in a MEMORY table, which every restart empties.
//! A MEMORY table is locked whole for the length of each statement that reads it, so no
//! statement that may wait for a lock reads it: each session reads the offset once, with
//! the bound it may hand tokens out to and the server the life belongs to, into its own
//! variables `@dlock_fence_off`, `@dlock_fence_high` and `@dlock_fence_server` (a restart
//! ends the session, and its variables with it), and the acquiring statements read those.
//! A draw counts only while `@@GLOBAL.server_id` is still the life's server: a session whose server
//! changed its id meanwhile (or that joined on another server's life) draws nothing and
//! joins again, so it never hands out a token of a life another session has replaced.
//!
//! The bound is raised by an autocommitted UPDATE, whose COMMIT has flushed the redo log
//! (with `innodb_flush_log_at_trx_commit = 1`, the default) when it returns. InnoDB lets
//! other sessions see a commit before its flush, so a session never takes its bound from
//! someone else's commit: only from its own, which flushes theirs too.

use super::super::fence::{Drawn, STEP};
use super::super::shared::One;
use crate::backend::stmt::stmt;
use crate::backend::Flavor;
use diesel::mysql::MysqlConnection;
use diesel::sql_types::{BigInt, Nullable};
use diesel::{OptionalExtension, QueryResult, QueryableByName, RunQueryDsl};

#[derive(QueryableByName)]
struct Value {
    #[diesel(sql_type = Nullable<BigInt>)]
    value: Option<i64>,
}

/// Raises the bound to at least `floor + STEP`, durably, and makes it this session's bound.
fn raise_from(conn: &mut MysqlConnection, floor: i64) -> QueryResult<i64> {
    // LAST_INSERT_ID(expr) hands the new value back to this session alone.
    let n =
        stmt("UPDATE dlock_fence SET high = LAST_INSERT_ID(GREATEST(high, ?) + ?) WHERE id = 1")
            .bind::<BigInt, _>(floor)
            .bind::<BigInt, _>(STEP)
            .execute(conn)?;
    if n != 1 {
        return Err(missing());
    }
    let high = stmt("SELECT CAST(@dlock_fence_high := LAST_INSERT_ID() AS SIGNED) AS value")
        .get_result::<Value>(conn)?
        .value
        .ok_or_else(missing)?;
    Ok(high)
}

fn missing() -> diesel::result::Error {
    diesel::result::Error::QueryBuilderError("the dlock_fence row is missing: run migrate()".into())
}

/// `fence_prepare(Some(token))`: raises the bound past `token`.
pub(super) fn raise(conn: &mut MysqlConnection, token: i64) -> QueryResult<()> {
    raise_from(conn, token).map(drop)
}

/// `fence_prepare(None)`: makes this session know the server's current life, starting it if
/// nobody has. A new life's offset puts every token of it above the bound every token of the
/// last life stayed under (read, and raised, by this session's own durable commit first) and
/// above the server's clock floor (`mysql_floor!`).
///
/// A life belongs to the server that started it (`server`, its `@@GLOBAL.server_id`, which
/// replication requires to differ between a primary and its replicas). The MEMORY table's
/// row reaches replicas like any other row, so a promoted replica finds the old primary's
/// life there; it starts a life of its own instead, above its clock, since its copy of the
/// bound may lag behind tokens the old primary handed out.
pub(super) fn join(conn: &mut MysqlConnection) -> QueryResult<()> {
    let high = raise_from(conn, 0)?;
    let off = |c: &mut MysqlConnection| {
        stmt("SELECT off AS value FROM dlock_fence_live WHERE id = 1 AND server = @@GLOBAL.server_id")
            .get_result::<Value>(c)
            .optional()
            .map(|v| v.and_then(|v| v.value))
    };
    if off(conn)?.is_none() {
        // A life from before lives had a server was started here by processes of an older
        // version, which may still be running: this server's, and kept. (A promoted replica
        // whose old primary ran such processes cannot tell it is not its own: see
        // docs/guide.md, Guarantees, Upgrading.)
        stmt("UPDATE dlock_fence_live SET server = @@GLOBAL.server_id WHERE id = 1 AND server IS NULL")
            .execute(conn)?;
    }
    if off(conn)?.is_none() {
        // Another server's life: not ours. A row of this server's that another session put
        // in meanwhile stays.
        stmt("DELETE FROM dlock_fence_live WHERE id = 1 AND server <> @@GLOBAL.server_id")
            .execute(conn)?;
        // The least the source gives from now on (every value after it is larger), and the
        // clock floor, read in one statement.
        #[derive(QueryableByName)]
        struct Start {
            #[diesel(sql_type = BigInt)]
            least: i64,
            #[diesel(sql_type = BigInt)]
            floor: i64,
        }
        let start = stmt(concat!(
            "SELECT CAST(UUID_SHORT() & 72057594037927935 AS SIGNED) AS least, CAST(",
            mysql_floor!(),
            " AS SIGNED) AS floor"
        ))
        .get_result::<Start>(conn)?;
        // `high - STEP` is the bound before this session's raise: at least the last life's
        // on this server. Above the floor too, with the bound raised to match.
        let first = (high - STEP + 1).max(start.floor);
        if first > high - STEP + 1 {
            raise_from(conn, first)?;
        }
        // Of several sessions starting the life at once, the first insert wins.
        stmt("INSERT IGNORE INTO dlock_fence_live (id, off, server) VALUES (1, ?, @@GLOBAL.server_id)")
            .bind::<BigInt, _>(first - start.least)
            .execute(conn)?;
    }
    // The offset and the server it belongs to, set together: a change of @@GLOBAL.server_id
    // between a read and the SET cannot pair one life's offset with another's server.
    stmt(
        "SET @dlock_fence_off = (SELECT off FROM dlock_fence_live \
                                 WHERE id = 1 AND server = @@GLOBAL.server_id), \
             @dlock_fence_server = @@GLOBAL.server_id",
    )
    .execute(conn)?;
    off(conn)?.map(drop).ok_or_else(missing)
}

/// `fence_draw`: a token for a session that holds its lock already.
pub(super) fn draw(conn: &mut MysqlConnection) -> QueryResult<Drawn> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = Nullable<BigInt>)]
        token: Option<i64>,
        #[diesel(sql_type = Nullable<BigInt>)]
        high: Option<i64>,
    }
    let r = stmt(
        "SELECT CAST(UUID_SHORT() & 72057594037927935 AS SIGNED) + IF(@@GLOBAL.server_id = @dlock_fence_server, @dlock_fence_off, NULL) AS token, \
         CAST(@dlock_fence_high AS SIGNED) AS high",
    )
    .get_result::<Row>(conn)?;
    Ok(Drawn {
        token: r.token.filter(|t| *t > 0),
        high: r.high,
    })
}

/// This server's flavor: MariaDB has `@@in_transaction`, MySQL proper does not.
pub(super) fn flavor(conn: &mut MysqlConnection) -> QueryResult<Flavor> {
    let maria = stmt("SELECT CAST(VERSION() LIKE '%MariaDB%' AS SIGNED) AS one")
        .get_result::<One>(conn)?
        .one;
    Ok(if maria == 1 {
        Flavor::Standard
    } else {
        Flavor::Mysql
    })
}
