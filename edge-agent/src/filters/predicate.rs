//! Predicates over record fields, parsed once into a tree of closures.
//!
//! Grammar (keywords lower case):
//! ```text
//! expr  := and ("or" and)*
//! and   := unary ("and" unary)*
//! unary := "not" unary | "(" expr ")" | "exists(" name ")" | name op literal
//! op    := == | != | < | <= | > | >=
//! literal := number | "string" | true | false
//! ```
//! Field names are `[A-Za-z0-9_.]+`. Numbers compare numerically across i64 and f64. A
//! comparison with a missing field, or with a field of another type than the literal, is false
//! and counted in [`FilterStats`]. A hand-written parser was chosen over an expression crate:
//! the grammar is tiny and closures evaluate without any interpretation per record.

use sync::{Record, Value};
use thiserror::Error;

use super::FilterStats;

type Eval = Box<dyn Fn(&Record, &FilterStats) -> bool + Send + Sync>;

/// A compiled predicate.
pub struct Predicate(Eval);

impl Predicate {
    pub fn eval(&self, r: &Record, stats: &FilterStats) -> bool {
        (self.0)(r, stats)
    }
}

/// Why a predicate did not parse, with the byte offset.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("at byte {at}: {message}")]
pub struct PredicateError {
    pub at: usize,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Name(String),
    Num(f64),
    Str(String),
    Op(&'static str),
    LParen,
    RParen,
}

fn lex(text: &str) -> Result<Vec<(usize, Tok)>, PredicateError> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let start = i;
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        let tok = match c {
            b'(' => {
                i += 1;
                Tok::LParen
            }
            b')' => {
                i += 1;
                Tok::RParen
            }
            b'=' | b'!' | b'<' | b'>' => {
                let two = b.get(i + 1) == Some(&b'=');
                i += 1 + usize::from(two);
                Tok::Op(match (c, two) {
                    (b'=', true) => "==",
                    (b'!', true) => "!=",
                    (b'<', true) => "<=",
                    (b'>', true) => ">=",
                    (b'<', false) => "<",
                    (b'>', false) => ">",
                    _ => {
                        return Err(PredicateError {
                            at: start,
                            message: "expected == != < <= > >=".into(),
                        });
                    }
                })
            }
            b'"' => {
                let end = text[i + 1..].find('"').ok_or(PredicateError {
                    at: start,
                    message: "unterminated string".into(),
                })?;
                let s = text[i + 1..i + 1 + end].to_owned();
                i += end + 2;
                Tok::Str(s)
            }
            b'-' | b'0'..=b'9' => {
                i += 1;
                while i < b.len()
                    && (b[i].is_ascii_digit() || matches!(b[i], b'.' | b'e' | b'E' | b'+' | b'-'))
                {
                    i += 1;
                }
                Tok::Num(text[start..i].parse().map_err(|_| PredicateError {
                    at: start,
                    message: format!("bad number {:?}", &text[start..i]),
                })?)
            }
            c if c.is_ascii_alphabetic() || c == b'_' => {
                while i < b.len() && (b[i].is_ascii_alphanumeric() || matches!(b[i], b'_' | b'.')) {
                    i += 1;
                }
                Tok::Name(text[start..i].to_owned())
            }
            _ => {
                return Err(PredicateError {
                    at: start,
                    message: format!("unexpected {:?}", c as char),
                });
            }
        };
        out.push((start, tok));
    }
    Ok(out)
}

struct Parser {
    toks: Vec<(usize, Tok)>,
    pos: usize,
    len: usize,
}

impl Parser {
    fn at(&self) -> usize {
        self.toks.get(self.pos).map_or(self.len, |t| t.0)
    }
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos).map(|t| &t.1)
    }
    fn err<T>(&self, message: &str) -> Result<T, PredicateError> {
        Err(PredicateError {
            at: self.at(),
            message: message.into(),
        })
    }
    fn keyword(&mut self, k: &str) -> bool {
        if matches!(self.peek(), Some(Tok::Name(n)) if n == k) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn expr(&mut self) -> Result<Eval, PredicateError> {
        let mut left = self.and()?;
        while self.keyword("or") {
            let right = self.and()?;
            left = Box::new(move |r, s| left(r, s) || right(r, s));
        }
        Ok(left)
    }

    fn and(&mut self) -> Result<Eval, PredicateError> {
        let mut left = self.unary()?;
        while self.keyword("and") {
            let right = self.unary()?;
            left = Box::new(move |r, s| left(r, s) && right(r, s));
        }
        Ok(left)
    }

    fn unary(&mut self) -> Result<Eval, PredicateError> {
        if self.keyword("not") {
            let inner = self.unary()?;
            return Ok(Box::new(move |r, s| !inner(r, s)));
        }
        if self.peek() == Some(&Tok::LParen) {
            self.pos += 1;
            let inner = self.expr()?;
            if self.peek() != Some(&Tok::RParen) {
                return self.err("expected )");
            }
            self.pos += 1;
            return Ok(inner);
        }
        let Some(Tok::Name(name)) = self.peek().cloned() else {
            return self.err("expected a field name, not, exists( or (");
        };
        self.pos += 1;
        if name == "exists" && self.peek() == Some(&Tok::LParen) {
            self.pos += 1;
            let Some(Tok::Name(field)) = self.peek().cloned() else {
                return self.err("expected a field name");
            };
            self.pos += 1;
            if self.peek() != Some(&Tok::RParen) {
                return self.err("expected )");
            }
            self.pos += 1;
            return Ok(Box::new(move |r, _| {
                r.fields.iter().any(|(n, _)| *n == field)
            }));
        }
        let Some(Tok::Op(op)) = self.peek().cloned() else {
            return self.err("expected == != < <= > >=");
        };
        self.pos += 1;
        let lit = match self.peek().cloned() {
            Some(Tok::Num(n)) => Literal::Num(n),
            Some(Tok::Str(s)) => Literal::Str(s),
            Some(Tok::Name(n)) if n == "true" => Literal::Bool(true),
            Some(Tok::Name(n)) if n == "false" => Literal::Bool(false),
            _ => return self.err("expected a number, a \"string\", true or false"),
        };
        self.pos += 1;
        Ok(compare(name, op, lit))
    }
}

enum Literal {
    Num(f64),
    Str(String),
    Bool(bool),
}

fn holds(op: &str, ord: std::cmp::Ordering) -> bool {
    use std::cmp::Ordering::*;
    match op {
        "==" => ord == Equal,
        "!=" => ord != Equal,
        "<" => ord == Less,
        "<=" => ord != Greater,
        ">" => ord == Greater,
        _ => ord != Less,
    }
}

fn compare(field: String, op: &'static str, lit: Literal) -> Eval {
    Box::new(move |r, stats| {
        let Some((_, v)) = r.fields.iter().find(|(n, _)| *n == field) else {
            stats.missing();
            return false;
        };
        let ord = match (v, &lit) {
            (Value::F64(x), Literal::Num(y)) => x.partial_cmp(y),
            (Value::I64(x), Literal::Num(y)) => (*x as f64).partial_cmp(y),
            (Value::Str(x), Literal::Str(y)) => Some(x.as_str().cmp(y.as_str())),
            (Value::Bool(x), Literal::Bool(y)) => Some(x.cmp(y)),
            _ => {
                stats.mismatch();
                return false;
            }
        };
        // NaN compares as nothing: every comparison with it is false.
        ord.is_some_and(|o| holds(op, o))
    })
}

/// Parses `text` once into a predicate.
pub fn compile(text: &str) -> Result<Predicate, PredicateError> {
    let toks = lex(text)?;
    let mut p = Parser {
        toks,
        pos: 0,
        len: text.len(),
    };
    let e = p.expr()?;
    if p.pos != p.toks.len() {
        return p.err("unexpected text after the expression");
    }
    Ok(Predicate(e))
}
