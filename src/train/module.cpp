// placeholder so the module library exists until its first source lands; delete when adding one.
namespace plm::train {}
