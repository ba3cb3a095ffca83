/*
 * s3conf.c - where an s3:// store is and as whom amber reaches it: the bucket and
 * prefix of the URL, then endpoint, region and credentials from the standard AWS
 * environment variables and files, read as the AWS CLI and SDKs read them (the
 * precedence is in s3.h), so that a store works wherever `aws s3 ls` does.
 *
 * The files are INI: "[section]" lines, "key = value" lines, '#' and ';' comments,
 * and nested blocks ("s3 =" followed by indented "key = value" lines). The
 * credentials file names its sections by profile ("[default]", "[NAME]"); the config
 * file as "[default]" or "[profile NAME]". Needs no library: built with or without
 * libcurl, so that the tests of this file run everywhere.
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "s3.h"

static char *dup_str(const char *s) {
  return s ? strdup(s) : NULL;
}

static const char *env(const char *name) {
  const char *v = getenv(name);
  return v && *v ? v : NULL;
}

static char *trim(char *s) {
  while (isspace((unsigned char)*s))
    s++;
  size_t n = strlen(s);
  while (n > 0 && isspace((unsigned char)s[n - 1]))
    s[--n] = 0;
  return s;
}

/* The value of `key` in section `section` of the INI file at `path`, inside the
 * nested block `block` when not NULL; a new string, or NULL. *found_section is set
 * when the section exists. */
static char *ini_get(const char *path, const char *section, const char *block,
                     const char *key, int *found_section) {
  FILE *f = path ? fopen(path, "r") : NULL;
  if (!f) return NULL;
  char line[4096], *value = NULL;
  int in_section = 0, in_block = 0;
  while (!value && fgets(line, sizeof line, f)) {
    int indented = line[0] == ' ' || line[0] == '\t';
    char *l = trim(line);
    if (!*l || *l == '#' || *l == ';') continue;
    if (*l == '[') {
      char *end = strchr(l, ']');
      if (!end) continue;
      *end = 0;
      in_section = strcmp(trim(l + 1), section) == 0;
      if (in_section && found_section) *found_section = 1;
      in_block = 0;
      continue;
    }
    if (!in_section) continue;
    char *eq = strchr(l, '=');
    if (!eq) continue;
    *eq = 0;
    char *k = trim(l), *v = trim(eq + 1);
    if (!indented) { /* a top-level key ends any block; "s3 =" starts one */
      in_block = block && !*v && strcmp(k, block) == 0;
      if (!block && strcmp(k, key) == 0) value = strdup(v);
    } else if (block && in_block && strcmp(k, key) == 0) {
      value = strdup(v);
    }
  }
  fclose(f);
  return value;
}

/* Whether the INI file at `path` has the section (no key is named "=" once trimmed). */
static int ini_has(const char *path, const char *section) {
  int found = 0;
  free(ini_get(path, section, NULL, "=", &found));
  return found;
}

/* "~/.aws/NAME", or the file the environment variable names. */
static char *aws_file(const char *var, const char *name) {
  const char *p = env(var);
  if (p) return strdup(p);
  const char *home = env("HOME");
  if (!home) return NULL;
  size_t n = strlen(home) + strlen(name) + 8;
  char *path = malloc(n);
  if (path) snprintf(path, n, "%s/.aws/%s", home, name);
  return path;
}

static int parse_url(amber__s3_conf *c, const char *url) {
  if (strncmp(url, "s3://", 5) != 0)
    return amber__fail(NULL, AMBER_EINVAL, "%s: not an s3:// URL", url);
  const char *b = url + 5, *slash = strchr(b, '/');
  size_t blen = slash ? (size_t)(slash - b) : strlen(b);
  /* S3's rule for new buckets: 3 to 63 of a-z, 0-9, '.', '-'. */
  int ok = blen >= 3 && blen <= 63;
  for (size_t i = 0; ok && i < blen; i++)
    ok = islower((unsigned char)b[i]) || isdigit((unsigned char)b[i]) || b[i] == '.' ||
         b[i] == '-';
  if (!ok)
    return amber__fail(NULL, AMBER_EINVAL,
                       "%s: '%.*s' is not a bucket name (3 to 63 of a-z, 0-9, '.', '-')",
                       url, (int)blen, b);
  c->bucket = strndup(b, blen);
  const char *p = slash ? slash + 1 : "";
  size_t plen = strlen(p);
  while (plen > 0 && p[plen - 1] == '/')
    plen--;
  c->prefix = malloc(plen + 2);
  if (!c->bucket || !c->prefix) return AMBER_ENOMEM;
  memcpy(c->prefix, p, plen);
  if (plen) c->prefix[plen++] = '/';
  c->prefix[plen] = 0;
  if (strstr(c->prefix, "//"))
    return amber__fail(NULL, AMBER_EINVAL, "%s: empty path segment in the prefix", url);
  return 0;
}

static int truthy(const char *v) {
  return v && (strcmp(v, "true") == 0 || strcmp(v, "1") == 0);
}

int amber__s3_conf_load(amber__s3_conf *c, const char *url) {
  memset(c, 0, sizeof *c);
  int rc = parse_url(c, url);
  if (rc < 0) goto fail;

  const char *profile = env("AWS_PROFILE");
  if (!profile) profile = env("AWS_DEFAULT_PROFILE");
  int named = profile != NULL;
  if (!profile) profile = "default";
  char csec[300], *cred_path = aws_file("AWS_SHARED_CREDENTIALS_FILE", "credentials");
  char *conf_path = aws_file("AWS_CONFIG_FILE", "config");
  if (strcmp(profile, "default") == 0)
    snprintf(csec, sizeof csec, "default");
  else
    snprintf(csec, sizeof csec, "profile %s", profile);
  int in_creds = 0, in_conf = 0;

  if (env("AWS_ACCESS_KEY_ID") && env("AWS_SECRET_ACCESS_KEY")) {
    c->key_id = dup_str(env("AWS_ACCESS_KEY_ID"));
    c->secret = dup_str(env("AWS_SECRET_ACCESS_KEY"));
    c->token = dup_str(env("AWS_SESSION_TOKEN"));
    c->creds_from = dup_str("credentials from AWS_ACCESS_KEY_ID");
  } else {
    /* The credentials file first, then the config file, each as a whole: a key id
     * from one is never paired with a secret from the other. */
    const char *files[2] = {cred_path, conf_path}, *secs[2] = {profile, csec};
    for (int i = 0; i < 2 && !c->key_id; i++) {
      int *found = i == 0 ? &in_creds : &in_conf;
      char *id = ini_get(files[i], secs[i], NULL, "aws_access_key_id", found);
      char *secret = ini_get(files[i], secs[i], NULL, "aws_secret_access_key", found);
      if (id && secret) {
        c->key_id = id;
        c->secret = secret;
        c->token = ini_get(files[i], secs[i], NULL, "aws_session_token", found);
        char from[600];
        snprintf(from, sizeof from, "credentials of profile '%s' in %s", profile,
                 files[i]);
        c->creds_from = strdup(from);
      } else {
        free(id);
        free(secret);
      }
    }
  }
  /* Whether the profile exists at all decides the error for a named one. */
  in_creds |= ini_has(cred_path, profile);
  in_conf |= ini_has(conf_path, csec);

  const char *region = env("AWS_REGION");
  if (!region) region = env("AWS_DEFAULT_REGION");
  c->region = region ? strdup(region) : ini_get(conf_path, csec, NULL, "region", NULL);
  if (!c->region) c->region = strdup("us-east-1");

  if (!truthy(env("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"))) {
    const char *ep = env("AWS_ENDPOINT_URL_S3");
    if (!ep) ep = env("AWS_ENDPOINT_URL");
    c->endpoint = ep ? strdup(ep) : ini_get(conf_path, csec, "s3", "endpoint_url", NULL);
    if (!c->endpoint) c->endpoint = ini_get(conf_path, csec, NULL, "endpoint_url", NULL);
  }
  char *style = ini_get(conf_path, csec, "s3", "addressing_style", NULL);
  c->path_style = c->endpoint != NULL || strchr(c->bucket, '.') != NULL;
  if (style && strcmp(style, "path") == 0) c->path_style = 1;
  if (style && strcmp(style, "virtual") == 0 && !strchr(c->bucket, '.'))
    c->path_style = 0;
  free(style);

  if (named && !in_creds && !in_conf && !c->key_id) {
    rc = amber__fail(NULL, AMBER_EINVAL,
                     "%s: AWS profile '%s' (AWS_PROFILE) is in neither %s nor %s", url,
                     profile, cred_path ? cred_path : "~/.aws/credentials",
                     conf_path ? conf_path : "~/.aws/config");
  } else if (!c->key_id) {
    rc = amber__fail(NULL, AMBER_EPERM,
                     "%s: no AWS credentials: set AWS_ACCESS_KEY_ID and "
                     "AWS_SECRET_ACCESS_KEY, or give profile '%s' aws_access_key_id and "
                     "aws_secret_access_key in %s (credential_process, SSO and instance "
                     "roles are not read)",
                     url, profile, cred_path ? cred_path : "~/.aws/credentials");
  } else if (c->endpoint) {
    size_t n = strlen(c->endpoint);
    while (n > 0 && c->endpoint[n - 1] == '/')
      c->endpoint[--n] = 0;
    if (strncmp(c->endpoint, "http://", 7) != 0 &&
        strncmp(c->endpoint, "https://", 8) != 0)
      rc = amber__fail(NULL, AMBER_EINVAL,
                       "%s: endpoint '%s' is not an http:// or https:// URL", url,
                       c->endpoint);
  }
  free(cred_path);
  free(conf_path);
  if (rc == 0 && (!c->region || !c->creds_from || !c->key_id || !c->secret))
    rc = AMBER_ENOMEM;
  if (rc == 0) return 0;
fail:
  amber__s3_conf_free(c);
  return rc;
}

void amber__s3_conf_free(amber__s3_conf *c) {
  char **fields[] = {&c->bucket, &c->prefix, &c->endpoint, &c->region,
                     &c->key_id, &c->secret, &c->token,    &c->creds_from};
  for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
    if (*fields[i] && fields[i] == &c->secret) memset(*fields[i], 0, strlen(*fields[i]));
    free(*fields[i]);
    *fields[i] = NULL;
  }
}
