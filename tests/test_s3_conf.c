/*
 * test_s3_conf.c - where an s3:// store is and as whom (src/s3conf.c): the URL's
 * bucket and prefix, and endpoint, region and credentials from the AWS environment
 * variables and files in the AWS CLI's precedence. Needs no server and no libcurl.
 */
#include <stdlib.h>
#include <string.h>

#include "s3.h"
#include "testutil.h"

static char cred[512], conf[512];

/* An environment with nothing of AWS in it but the two test files. */
static void clean_env(void) {
  const char *vars[] = {"AWS_ACCESS_KEY_ID",   "AWS_SECRET_ACCESS_KEY",
                        "AWS_SESSION_TOKEN",   "AWS_PROFILE",
                        "AWS_DEFAULT_PROFILE", "AWS_REGION",
                        "AWS_DEFAULT_REGION",  "AWS_ENDPOINT_URL",
                        "AWS_ENDPOINT_URL_S3", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"};
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
    unsetenv(vars[i]);
  setenv("AWS_SHARED_CREDENTIALS_FILE", cred, 1);
  setenv("AWS_CONFIG_FILE", conf, 1);
}

static void write_files(const char *credentials, const char *config) {
  CHECK(tu_write_file(cred, credentials, strlen(credentials)) == 0);
  CHECK(tu_write_file(conf, config, strlen(config)) == 0);
}

static void test_url_gives_bucket_and_prefix(void) {
  clean_env();
  setenv("AWS_ACCESS_KEY_ID", "id", 1);
  setenv("AWS_SECRET_ACCESS_KEY", "secret", 1);
  amber__s3_conf c;
  CHECK_OK(amber__s3_conf_load(&c, "s3://my-bucket"));
  CHECK(strcmp(c.bucket, "my-bucket") == 0 && strcmp(c.prefix, "") == 0);
  amber__s3_conf_free(&c);
  CHECK_OK(amber__s3_conf_load(&c, "s3://my-bucket/runs/gpt2//"));
  CHECK(strcmp(c.prefix, "runs/gpt2/") == 0);
  amber__s3_conf_free(&c);
  const char *bad[] = {"s3:/my-bucket", "file:///x",        "s3://",
                       "s3://ab",       "s3://My_Bucket/x", "s3://my-bucket/a//b"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    CHECK_RC(amber__s3_conf_load(&c, bad[i]), AMBER_EINVAL);
    CHECK(strstr(amber_last_error(NULL), bad[i]) != NULL);
  }
}

static void test_environment_credentials_come_first(void) {
  clean_env();
  write_files(
      "[default]\naws_access_key_id = file-id\naws_secret_access_key = file-secret\n",
      "[default]\nregion = eu-west-3\n");
  setenv("AWS_ACCESS_KEY_ID", "env-id", 1);
  setenv("AWS_SECRET_ACCESS_KEY", "env-secret", 1);
  setenv("AWS_SESSION_TOKEN", "env-token", 1);
  amber__s3_conf c;
  CHECK_OK(amber__s3_conf_load(&c, "s3://bucket"));
  CHECK(strcmp(c.key_id, "env-id") == 0 && strcmp(c.secret, "env-secret") == 0);
  CHECK(c.token && strcmp(c.token, "env-token") == 0);
  CHECK(strcmp(c.region, "eu-west-3") == 0);      /* the profile's */
  CHECK(c.endpoint == NULL && c.path_style == 0); /* AWS, virtual-hosted */
  amber__s3_conf_free(&c);
  /* a key id without its secret is not a credential: the file's are used */
  unsetenv("AWS_SECRET_ACCESS_KEY");
  CHECK_OK(amber__s3_conf_load(&c, "s3://bucket"));
  CHECK(strcmp(c.key_id, "file-id") == 0 && strcmp(c.secret, "file-secret") == 0);
  CHECK(c.token == NULL);
  CHECK(strstr(c.creds_from, "profile 'default'") != NULL);
  amber__s3_conf_free(&c);
}

static void test_a_named_profile_reads_both_files(void) {
  clean_env();
  write_files("[default]\naws_access_key_id = d\naws_secret_access_key = ds\n"
              "; a comment\n[train]\naws_access_key_id = t\naws_secret_access_key = ts\n"
              "aws_session_token = tt\n",
              "[default]\nregion = us-west-2\n"
              "[profile train]\nregion = ap-south-1\nendpoint_url = http://plain:1\n"
              "s3 =\n  addressing_style = path\n  endpoint_url = http://nested:9000/\n"
              "other = 1\n[profile cfgonly]\naws_access_key_id = "
              "c\naws_secret_access_key = cs\n");
  setenv("AWS_PROFILE", "train", 1);
  amber__s3_conf c;
  CHECK_OK(amber__s3_conf_load(&c, "s3://bucket/p"));
  CHECK(strcmp(c.key_id, "t") == 0 && strcmp(c.secret, "ts") == 0);
  CHECK(c.token && strcmp(c.token, "tt") == 0);
  CHECK(strcmp(c.region, "ap-south-1") == 0);
  CHECK(c.endpoint && strcmp(c.endpoint, "http://nested:9000") == 0); /* s3's own first */
  CHECK(c.path_style == 1);
  amber__s3_conf_free(&c);
  /* the environment's region and endpoint before the profile's */
  setenv("AWS_DEFAULT_REGION", "eu-north-1", 1);
  setenv("AWS_ENDPOINT_URL", "http://general:1", 1);
  CHECK_OK(amber__s3_conf_load(&c, "s3://bucket/p"));
  CHECK(strcmp(c.region, "eu-north-1") == 0 &&
        strcmp(c.endpoint, "http://general:1") == 0);
  amber__s3_conf_free(&c);
  setenv("AWS_REGION", "sa-east-1", 1);
  setenv("AWS_ENDPOINT_URL_S3", "https://s3only:2", 1);
  CHECK_OK(amber__s3_conf_load(&c, "s3://bucket/p"));
  CHECK(strcmp(c.region, "sa-east-1") == 0 &&
        strcmp(c.endpoint, "https://s3only:2") == 0);
  amber__s3_conf_free(&c);
  setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true", 1);
  CHECK_OK(amber__s3_conf_load(&c, "s3://bucket/p"));
  CHECK(c.endpoint == NULL && c.path_style == 1); /* the profile's addressing_style */
  amber__s3_conf_free(&c);
  /* credentials that only the config file has */
  clean_env();
  setenv("AWS_PROFILE", "cfgonly", 1);
  CHECK_OK(amber__s3_conf_load(&c, "s3://bucket"));
  CHECK(strcmp(c.key_id, "c") == 0 && strstr(c.creds_from, conf) != NULL);
  CHECK(strcmp(c.region, "us-east-1") == 0); /* no region anywhere: AWS's default */
  amber__s3_conf_free(&c);
}

static void test_addressing_follows_endpoint_and_bucket_name(void) {
  clean_env();
  write_files("", "");
  setenv("AWS_ACCESS_KEY_ID", "id", 1);
  setenv("AWS_SECRET_ACCESS_KEY", "secret", 1);
  amber__s3_conf c;
  CHECK_OK(amber__s3_conf_load(&c, "s3://with.dots"));
  CHECK(c.path_style == 1); /* TLS names cannot hold the dots */
  amber__s3_conf_free(&c);
  setenv("AWS_ENDPOINT_URL", "ftp://x", 1);
  CHECK_RC(amber__s3_conf_load(&c, "s3://bucket"), AMBER_EINVAL);
  CHECK(strstr(amber_last_error(NULL), "ftp://x") != NULL);
}

static void test_missing_profile_and_missing_credentials_are_explained(void) {
  clean_env();
  write_files("[default]\naws_access_key_id = d\naws_secret_access_key = ds\n", "");
  setenv("AWS_PROFILE", "nosuch", 1);
  amber__s3_conf c;
  CHECK_RC(amber__s3_conf_load(&c, "s3://bucket"), AMBER_EINVAL);
  CHECK(strstr(amber_last_error(NULL), "profile 'nosuch'") != NULL);
  CHECK(strstr(amber_last_error(NULL), cred) != NULL);
  clean_env();
  write_files("", "[default]\nregion = eu-west-1\n");
  CHECK_RC(amber__s3_conf_load(&c, "s3://bucket"), AMBER_EPERM);
  CHECK(strstr(amber_last_error(NULL), "no AWS credentials") != NULL);
  CHECK(strstr(amber_last_error(NULL), "AWS_ACCESS_KEY_ID") != NULL);
}

int main(void) {
  snprintf(cred, sizeof cred, "%s/credentials", tu_tmpdir());
  snprintf(conf, sizeof conf, "%s/config", tu_tmpdir());
  TEST_RUN(test_url_gives_bucket_and_prefix);
  TEST_RUN(test_environment_credentials_come_first);
  TEST_RUN(test_a_named_profile_reads_both_files);
  TEST_RUN(test_addressing_follows_endpoint_and_bucket_name);
  TEST_RUN(test_missing_profile_and_missing_credentials_are_explained);
  return tu_finish();
}
