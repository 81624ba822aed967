//! A docs page's first example as a test runs it: the page's first `sh` block as commands
//! ([`first_sh_block`]), each split into words as a shell would ([`shell_words`]). The docs
//! pages open with an example and the binaries' tests run it, so the example cannot drift from
//! the binary; a block that changes shape fails the test rather than being skipped.

/// The commands of the first ```` ```sh ```` block of `page`, `\` continuation lines joined by a
/// space and a trailing `# comment` cut.
///
/// # Panics
///
/// When the page has no `sh` block, the block is not closed, or it ends inside a command: a
/// test that reads a page fails rather than running nothing.
pub fn first_sh_block(page: &str) -> Vec<String> {
    let mut lines = page.lines().skip_while(|l| l.trim() != "```sh");
    assert!(lines.next().is_some(), "the page has no ```sh block");
    let mut commands = Vec::new();
    let mut open = String::new();
    for line in lines {
        let line = line.trim();
        if line == "```" {
            assert!(open.is_empty(), "the ```sh block ends inside a command");
            return commands;
        }
        match line.strip_suffix('\\') {
            Some(head) => {
                open.push_str(head.trim());
                open.push(' ');
            }
            None => {
                // A comment begins where ` #` does outside quotes; the pages put it after
                // two spaces, in no quoted word.
                let code = line.split_once("  #").map_or(line, |(code, _)| code);
                open.push_str(code.trim());
                commands.push(std::mem::take(&mut open));
            }
        }
    }
    panic!("the first ```sh block is not closed");
}

/// `text` split into words as a shell would for the quoting the pages use: words separated by
/// spaces, `'...'` and `"..."` kept whole without their quotes.
///
/// # Panics
///
/// On anything a shell would expand or redirect (`$`, backticks, `\`, `*`, `;`, `|`, `<`,
/// `>`) and on an unclosed quote: such an example needs a shell, and a test should not pretend
/// to run it.
pub fn shell_words(text: &str) -> Vec<String> {
    assert!(
        !text.contains(['$', '`', '\\', '*', ';', '|', '>', '<']),
        "{text:?} needs a shell: keep the example plain"
    );
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut quote: Option<char> = None;
    for c in text.chars() {
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => word.get_or_insert_default().push(c),
            None if c == '\'' || c == '"' => {
                quote = Some(c);
                word.get_or_insert_default();
            }
            None if c == ' ' => words.extend(word.take()),
            None => word.get_or_insert_default().push(c),
        }
    }
    assert!(quote.is_none(), "an unclosed quote in {text:?}");
    words.extend(word);
    words
}

/// The words after `prefix` (`"cargo run --release -p k3-serve --"`) in `command`.
///
/// # Panics
///
/// When `command` does not begin with `prefix` and a space.
pub fn args_after(command: &str, prefix: &str) -> Vec<String> {
    let rest = command
        .strip_prefix(prefix)
        .and_then(|rest| rest.strip_prefix(' '))
        .unwrap_or_else(|| panic!("{command:?} does not begin with {prefix:?}"));
    shell_words(rest)
}
