//! Keeping secrets out of output: a MongoDB URI is printed only with its password masked.

/// `mongodb://user:secret@host/db` → `mongodb://user:***@host/db`. Works on multi-host URIs and on
/// strings that are not URIs at all (they come back unchanged).
pub(crate) fn redact_uri(uri: &str) -> String {
    let Some(scheme_end) = uri.find("://") else {
        return uri.to_owned();
    };
    let rest = &uri[scheme_end + 3..];
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else {
        return uri.to_owned();
    };
    let userinfo = &authority[..at];
    let user = userinfo.split(':').next().unwrap_or("");
    let masked = if userinfo.contains(':') {
        format!("{user}:***")
    } else {
        user.to_owned()
    };
    format!("{}{}{}", &uri[..scheme_end + 3], masked, &rest[at..])
}

/// Removes the password of `uri` from any text (a driver error may echo parts of the URI).
pub(crate) fn scrub(text: &str, uri: &str) -> String {
    match password_of(uri) {
        Some(password) if !password.is_empty() => text.replace(password, "***"),
        _ => text.to_owned(),
    }
}

fn password_of(uri: &str) -> Option<&str> {
    let rest = &uri[uri.find("://")? + 3..];
    let authority = &rest[..rest.find(['/', '?']).unwrap_or(rest.len())];
    let userinfo = &authority[..authority.rfind('@')?];
    userinfo.split_once(':').map(|(_, password)| password)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_masked() {
        assert_eq!(
            redact_uri("mongodb://admin:s3cr3t@a:1,b:2/db?replicaSet=rs"),
            "mongodb://admin:***@a:1,b:2/db?replicaSet=rs"
        );
        assert_eq!(redact_uri("mongodb://h:27017"), "mongodb://h:27017");
        assert_eq!(redact_uri("mongodb://user@h"), "mongodb://user@h");
        assert_eq!(redact_uri("not a uri"), "not a uri");
    }

    #[test]
    fn scrub_removes_the_password_anywhere() {
        let uri = "mongodb://admin:s3cr3t@h/";
        assert_eq!(scrub("auth failed for s3cr3t", uri), "auth failed for ***");
        assert_eq!(scrub("plain", "mongodb://h/"), "plain");
    }
}
