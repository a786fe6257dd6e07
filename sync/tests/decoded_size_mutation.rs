//! Mutation check of the decoded-size guard: with it switched off (`block::mutation`, feature
//! `fault-injection`), the check the bomb tests make (`decoded_support::check_refused`) fails,
//! so those tests would catch a decoder that builds records before bounding them. One test in
//! its own binary, because the switch is process-wide.
#![allow(unsafe_code)] // The counting allocator in `decoded_support`; nothing else.

mod decoded_support;

use sync::block::{DecodeLimits, mutation};

#[test]
fn the_bomb_check_fails_with_the_guard_switched_off() {
    // 2,000 records copying one 4,000-byte key: 8 MB decoded, a 1 MiB limit.
    let bomb = decoded_support::key_bomb(4000, 2000);
    let limits = DecodeLimits {
        decoded_bytes_max: 1 << 20,
        ..DecodeLimits::default()
    };
    let guarded = decoded_support::check_refused(&bomb, &limits);
    assert!(guarded.is_ok(), "with the guard on: {guarded:?}");
    mutation::set_decoded_size_guard_off(true);
    let unguarded = decoded_support::check_refused(&bomb, &limits);
    mutation::set_decoded_size_guard_off(false);
    let Err(failure) = unguarded else {
        panic!("the check passed with the guard switched off");
    };
    println!("with the guard off the check fails, as it must: {failure}");
    assert!(failure.contains("not refused"), "{failure}");

    // The fuzz targets' decoded-size contract catches the same bug: a 20 MB bomb against the
    // targets' 16 MiB limit passes with the guard on and panics with it off.
    let big = decoded_support::key_bomb(4000, 5000);
    sync::fuzzing::block_decode(&big);
    mutation::set_decoded_size_guard_off(true);
    let caught = std::panic::catch_unwind(|| sync::fuzzing::block_decode(&big));
    mutation::set_decoded_size_guard_off(false);
    let Err(panic) = caught else {
        panic!("the fuzz target's contract passed with the guard switched off");
    };
    let text = panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(text.contains("within the limit"), "{text}");
}
