"""`qualify`: first, repeated and concurrent requests judged by the strict evidence rules,
with an allowlisted receipt (`run`, `receipt`, `prompts`)."""
